"""A SentencePiece (``tokenizer.ggml.model == "llama"``) vocabulary as Llama 2 / TinyLlama GGUFs carry it:
tokens, scores and token types but no merges. armillary's tokenizer must equal transformers' on it."""
from __future__ import annotations

import random

import pytest
from gguf import GGMLQuantizationType as Q
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from armillary_llama.gguf_source import GGUFSource
from armillary_llama.gguf_tokenizer import merges_from_scores

CORPUS = ["the cat sat on the mat", "a theme of the thesis: that the heat is there",
          "Hello world, hello there! The weather is hot; the other hat is theirs."] * 20
TEXTS = [*CORPUS[:3], "the cat sat", "Hello world", "  two leading spaces", "the\nnew line", "unknown ☃ chars ü 🙂",
         "<s>the</s> hat", "<|user|>hi<|end|>", "thesis", ""]


def _sentencepiece_vocab() -> tuple[list[str], list[float], list[int]]:
    """Train a small Metaspace BPE, then lay it out as llama.cpp does: specials, 256 byte tokens, pieces.

    Piece scores are shuffled so that the merge order follows the scores alone, not the training order.
    """
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    trained.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=120, show_progress=False))
    pieces = [t for t, _ in sorted(trained.get_vocab().items(), key=lambda item: item[1])]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces, "<|user|>", "<|end|>"]
    ranks = random.Random(0).sample(range(len(pieces)), len(pieces))
    scores = [0.0] * 259 + [-float(r) for r in ranks] + [0.0, 0.0]
    types = [2, 3, 3, *([6] * 256), *([1] * len(pieces)), 4, 3]
    return tokens, scores, types


@pytest.fixture
def sentencepiece_gguf(tmp_path, tiny_llama, gguf_writer):
    tokens, scores, types = _sentencepiece_vocab()

    def add_vocabulary(writer) -> None:
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_unk_token_id(0)
        writer.add_chat_template("{% for m in messages %}<|user|>{{ m['content'] }}<|end|>{% endfor %}")

    _, hf_model = tiny_llama(vocab_size=len(tokens))
    return gguf_writer(hf_model, tmp_path / "spm.gguf", Q.F32, metadata=add_vocabulary)


def test_sentencepiece_tokenizer_equals_transformers(sentencepiece_gguf):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(sentencepiece_gguf.parent), gguf_file=sentencepiece_gguf.name)
    ours = GGUFSource(str(sentencepiece_gguf)).tokenizer()
    assert ours.vocab_size == len(reference)
    assert ours.special_tokens_map == {k: reference.special_tokens_map[k] for k in ours.special_tokens_map}
    for text in TEXTS:
        ids = reference(text, add_special_tokens=True).input_ids
        assert ours.encode(text, add_special_tokens=True) == ids, text
        assert ids[:1] == [1]  # SentencePiece vocabularies get BOS unless the file says otherwise
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
    messages = [{"role": "user", "content": "the cat"}]
    assert ours.apply_chat_template(messages) == reference.apply_chat_template(messages, tokenize=False)


def test_merges_rank_by_merged_token_score():
    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    scores = [0.0, 0.0, 0.0, -2.0, -1.0, -3.0]
    assert merges_from_scores(tokens, scores) == [("b", "c"), ("a", "b"), ("ab", "c"), ("a", "bc")]
