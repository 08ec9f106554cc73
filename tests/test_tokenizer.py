"""Tokenizer and incremental detokenizer against transformers' tokenizer on the same directory."""
from __future__ import annotations

import json
import random

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from armillary.detokenizer import IncrementalDetokenizer
from armillary.errors import ModelNotFoundError
from armillary.tokenizer import Tokenizer
from tests.fixtures.tiny_tokenizer import QWEN_ADDED_TOKENS, make_qwen_tokenizer

TEXTS = [
    "",
    "Hello, world!",
    "The weather in Paris is sunny; call get_weather(city=\"Berlin\").",
    "  leading and trailing spaces  \n\n\ttabs\r\nand CRLF\n",
    '{"name": "search", "arguments": {"query": "naïve café", "limit": 3}}',
    "def add(a: int, b: int) -> int:\n    return a + b\n",
    "中文测试：你好，世界！日本語のテキスト。한국어 텍스트",
    "emoji 😀🎉👩‍👩‍👧‍👦 and flags 🇫🇷🇯🇵 mixed with text",
    "combining e\u0301 vs \u00e9 (NFC), zero\u200bwidth, Ω≈ç√∫",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\nhmm\n</think>\n\nHello<|endoftext|>",
    "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>",
    "Numbers 1234567890 and 3.14159, I'm sure it's what we'd've done",
]


def test_fixture_ids_fit_vocab_and_flags(tok_dir):
    for vocab_size in (300, 512):
        make_qwen_tokenizer(tok_dir / f"v{vocab_size}", vocab_size=vocab_size)
        small = Tokenizer.from_pretrained(tok_dir / f"v{vocab_size}")
        assert small.vocab_size <= vocab_size
        ids = [small.token_to_id(content) for content, _ in QWEN_ADDED_TOKENS]
        assert all(i is not None and i < vocab_size for i in ids)
    with pytest.raises(ValueError, match="vocab_size"):
        make_qwen_tokenizer(tok_dir / "too_small", vocab_size=200)


def test_fixture_is_deterministic(tmp_path):
    make_qwen_tokenizer(tmp_path / "a")
    make_qwen_tokenizer(tmp_path / "b")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_real_words_are_multi_char_tokens(tok):
    tokens = [tok.id_to_token(i) for i in tok.encode("The weather in Paris")]
    assert len(tokens) < len("The weather in Paris") / 2


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tok, hf, text):
    assert tok.encode(text) == hf.encode(text, add_special_tokens=False)
    assert tok.encode(text, add_special_tokens=True) == hf.encode(text, add_special_tokens=True)


def test_encode_matches_plain_fast_tokenizer(tok, tok_dir):
    fast = PreTrainedTokenizerFast(tokenizer_file=str(tok_dir / "tokenizer.json"))
    for text in TEXTS:
        assert tok.encode(text) == fast.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("skip", [True, False])
def test_decode_matches_transformers(tok, hf, skip):
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 12))]
        assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_special_token_attributes(tok, hf):
    assert tok.vocab_size == len(hf)
    assert tok.eos_token_id == hf.eos_token_id == tok.token_to_id("<|im_end|>")
    assert tok.pad_token_id == hf.pad_token_id == tok.token_to_id("<|endoftext|>")
    assert tok.bos_token_id is None and hf.bos_token_id is None
    assert tok.all_special_ids == sorted(hf.all_special_ids)
    assert tok.token_to_id("<think>") not in tok.all_special_ids  # Qwen: tags are added, not special
    assert tok.eos_token_ids == (tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>"))
    assert tok.special_tokens_map == hf.special_tokens_map
    assert tok.id_to_token(tok.token_to_id("<tool_call>")) == "<tool_call>"
    assert tok.token_to_id("definitely-not-a-token") is None


def test_config_special_tokens_are_forced_special(tok_dir, tmp_path):
    """A token listed as special in tokenizer_config.json is skipped on decode, as in transformers."""
    for name in ("tokenizer.json", "generation_config.json", "chat_template.jinja"):
        (tmp_path / name).write_bytes((tok_dir / name).read_bytes())
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    config["additional_special_tokens"] = ["<|im_start|>", "<|im_end|>", "<think>"]
    config["added_tokens_decoder"]["600"] = {"content": "<extra_tag>", "special": False, "normalized": False,
                                             "lstrip": False, "rstrip": False, "single_word": False}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours, theirs = Tokenizer.from_pretrained(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    assert ours.token_to_id("<think>") in ours.all_special_ids
    text = "<think>x</think> <extra_tag>y"
    ids = ours.encode(text)
    assert ids == theirs.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


def test_missing_tokenizer_json_is_clear(tmp_path):
    (tmp_path / "vocab.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match="no tokenizer.json.*vocab.json"):
        Tokenizer.from_pretrained(tmp_path)


# --- incremental detokenizer --------------------------------------------------------------------


def _stream(tok, ids, skip=True, prompt_ids=()):
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip, prompt_ids=prompt_ids)
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == detok.text
    return deltas


@pytest.mark.parametrize("skip", [True, False])
def test_detokenizer_matches_decode_on_texts(tok, skip):
    for text in TEXTS:
        ids = tok.encode(text)
        deltas = _stream(tok, ids, skip)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
        assert all("\ufffd" not in d for d in deltas)  # valid text never shows a half character


def test_detokenizer_holds_split_multibyte_characters(tok):
    ids = tok.encode("😀")  # four byte-level tokens, none a whole character
    assert len(ids) == 4
    detok = IncrementalDetokenizer(tok)
    assert [detok.add(i) for i in ids] == ["", "", "", "😀"]


@pytest.mark.parametrize("skip", [True, False])
def test_detokenizer_matches_decode_on_random_ids(tok, skip):
    rng = random.Random(1234)
    # Bias towards raw byte tokens (ids < 256 in the byte-level alphabet) to split characters often.
    byte_ids = [tok.token_to_id(t) for t in {tok.id_to_token(i) for i in range(256)}]
    for _ in range(300):
        n = rng.randrange(1, 40)
        ids = [rng.choice(byte_ids) if rng.random() < 0.5 else rng.randrange(tok.vocab_size) for _ in range(n)]
        deltas = _stream(tok, ids, skip)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)


def test_detokenizer_with_prompt_context(tok):
    prompt = tok.encode("<|im_start|>assistant\nSure, here it is: ")
    generated = tok.encode("naïve café 😀 done<|im_end|>")
    full = tok.decode(prompt + generated)
    expected = full[len(tok.decode(prompt)):]
    assert "".join(_stream(tok, generated, prompt_ids=prompt)) == expected
