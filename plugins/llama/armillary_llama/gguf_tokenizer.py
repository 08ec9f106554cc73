"""Build an ``armillary.tokenizer.Tokenizer`` from a GGUF's ``tokenizer.*`` metadata.

A GGUF carries no ``tokenizer.json``: it stores the vocabulary, merges, token types, special ids
and chat templates under llama.cpp's keys. Two tokenizer models are built:

- ``gpt2``: byte-level BPE (SmolLM, Llama 3, Qwen2 and most recent models). The pre-tokenizer split
  comes from ``tokenizer.ggml.pre``; an unknown one falls back to GPT-2's split with a warning, as
  transformers does.
- ``llama``: SentencePiece BPE with byte fallback (Llama 1/2, TinyLlama, Mistral). Files usually
  carry scores instead of merges; merges are derived from them (a pair's rank is its merged
  token's score).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from armillary.tokenizer import Tokenizer
from armillary_llama.gguf_config import end_of_generation_ids
from armillary_llama.gguf_file import GGUFError, GGUFFile

log = logging.getLogger(__name__)

SUPPORTED_MODELS = ("gpt2", "llama")
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types
_SPM_SPACE = "\u2581"  # SentencePiece's visible space
_SPECIAL_ID_KEYS = (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                    ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id"))

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLIT_BY_PRE = {
    "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# pre-tokenizer types whose split is GPT-2's own regex, optionally after cutting digits apart
_GPT2_PRE = {"default", "gpt2"}
_DIGITS_THEN_GPT2_PRE = {"smollm"}


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table: printable Latin-1 bytes map to themselves, the rest to U+0100.."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in kept}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _pre_tokenizer(pre: str, add_prefix_space: bool) -> pre_tokenizers.PreTokenizer:
    if pre in _SPLIT_BY_PRE:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT_BY_PRE[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False),
        ])
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)
    if pre in _DIGITS_THEN_GPT2_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre not in _GPT2_PRE:
        log.warning("GGUF pre-tokenizer %r is unknown to armillary-llama; splitting text as GPT-2 does", pre)
    return byte_level


def _byte_level_backend(gguf: GGUFFile, tokens: list[str]) -> BackendTokenizer:
    meta = gguf.metadata
    alphabet = byte_alphabet()
    printable = set(alphabet.values())
    # Tokens are stored in the byte alphabet already; respell any that are not (as transformers does).
    spelled = [t if set(t) <= printable else "".join(alphabet[b] for b in t.encode("utf-8")) for t in tokens]
    vocab = {token: i for i, token in enumerate(spelled)}
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=_file_merges(gguf), fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"),
                                           bool(meta.get("tokenizer.ggml.add_space_prefix", False)))
    backend.decoder = decoders.ByteLevel()

    # a control token outside the byte alphabet is a mislabelled byte-level token: adding it would grow the vocabulary
    _add_typed_tokens(backend, meta, spelled, keep=lambda token: set(token) <= printable)
    return backend


def _file_merges(gguf: GGUFFile) -> list[tuple[str, str]]:
    merges = []
    for i, merge in enumerate(gguf.metadata.get("tokenizer.ggml.merges") or []):
        pair = merge.split(" ")
        if len(pair) != 2:
            raise GGUFError(f"corrupt GGUF file {str(gguf.path)!r}: merge #{i} {merge!r} is not two tokens")
        merges.append((pair[0], pair[1]))
    return merges


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE as merges: every split of a token into two vocabulary pieces, best merged score first.

    Ties keep vocabulary order (left piece id, then right piece id); among equal scores longer pieces win.
    """
    vocab = {token: i for i, token in enumerate(tokens)}
    score_of = dict(zip(tokens, scores))
    ranked: list[tuple[float, str, str]] = []
    for token, score in score_of.items():
        pairs = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        pairs.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        ranked.extend((score, left, right) for left, right in pairs)
    ranked.sort(key=lambda entry: (entry[0], len(entry[1]), len(entry[2])), reverse=True)  # stable: ties keep order
    return [(left, right) for _, left, right in ranked]


def _sentencepiece_backend(gguf: GGUFFile, tokens: list[str]) -> BackendTokenizer:
    meta = gguf.metadata
    if "tokenizer.ggml.merges" in meta:
        merges = _file_merges(gguf)
    elif "tokenizer.ggml.scores" in meta:
        merges = merges_from_scores(tokens, meta["tokenizer.ggml.scores"])
    else:
        raise GGUFError(f"GGUF file {str(gguf.path)!r}: a SentencePiece vocabulary needs tokenizer.ggml.scores or merges")
    vocab = {token: i for i, token in enumerate(tokens)}
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True))
    prefix_space = bool(meta.get("tokenizer.ggml.add_space_prefix", True))  # llama.cpp honours it; transformers always prepends
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SPM_SPACE, split=False,
                                                     prepend_scheme="first" if prefix_space else "never")
    steps = [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if prefix_space else steps)
    _add_typed_tokens(backend, meta, tokens, keep=lambda token: True)
    return backend


def _add_typed_tokens(backend: BackendTokenizer, meta: dict[str, Any], tokens: list[str],
                      keep: Callable[[str], bool]) -> None:
    """Control tokens (type 3) become special added tokens, user-defined ones (type 4) plain added tokens,
    so both are matched whole in text as llama.cpp does."""
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, kind in zip(tokens, types) if kind == _CONTROL and keep(t)])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, kind in zip(tokens, types) if kind == _USER_DEFINED])


def _post_processor(meta: dict[str, Any], backend: BackendTokenizer,
                    add_bos_default: bool) -> processors.TemplateProcessing:
    """Adds BOS / EOS around a prompt as ``tokenizer.ggml.add_bos_token`` / ``add_eos_token`` say.

    Without the flag, SentencePiece vocabularies get BOS (llama.cpp's default for them) and byte-level ones do not.
    """
    template: list[str] = ["$A"]
    special: list[tuple[str, int]] = []
    for flag, key, default in (("add_bos_token", "bos_token_id", add_bos_default), ("add_eos_token", "eos_token_id", False)):
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if not meta.get(f"tokenizer.ggml.{flag}", default) or token_id is None:
            continue
        token = backend.id_to_token(token_id)
        if key == "bos_token_id":
            template.insert(0, token)
        else:
            template.append(token)
        special.append((token, token_id))
    return processors.TemplateProcessing(single=template, special_tokens=special)


def chat_templates(meta: dict[str, Any]) -> dict[str, str]:
    """``tokenizer.chat_template`` as the default, ``tokenizer.chat_template.NAME`` as named ones."""
    templates = {"default": meta["tokenizer.chat_template"]} if "tokenizer.chat_template" in meta else {}
    prefix = "tokenizer.chat_template."
    templates.update({key[len(prefix):]: value for key, value in meta.items() if key.startswith(prefix)})
    return templates


def gguf_tokenizer(gguf: GGUFFile) -> Tokenizer | None:
    """The file's tokenizer, None when it carries none; raises ``GGUFError`` for a tokenizer model we do not build."""
    meta = gguf.metadata
    model = meta.get("tokenizer.ggml.model")
    if model is None or "tokenizer.ggml.tokens" not in meta:
        return None
    if model not in SUPPORTED_MODELS:
        raise GGUFError(f"GGUF file {str(gguf.path)!r} has tokenizer model {model!r}; armillary-llama builds "
                        f"{list(SUPPORTED_MODELS)}. Pass --tokenizer with a Hugging Face checkpoint directory "
                        "holding the model's tokenizer.json instead")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    special_ids = {name: meta[f"tokenizer.ggml.{key}"] for name, key in _SPECIAL_ID_KEYS if f"tokenizer.ggml.{key}" in meta}
    for name, token_id in special_ids.items():
        if not 0 <= token_id < len(tokens):
            raise GGUFError(f"corrupt GGUF file {str(gguf.path)!r}: the {name} id {token_id} is outside the "
                            f"{len(tokens)}-token vocabulary")
    backend = _byte_level_backend(gguf, tokens) if model == "gpt2" else _sentencepiece_backend(gguf, tokens)
    backend.post_processor = _post_processor(meta, backend, add_bos_default=model == "llama")
    special_tokens = {name: backend.id_to_token(token_id) for name, token_id in special_ids.items()}
    # named special tokens are special even when the file types them as normal
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t in dict.fromkeys(special_tokens.values())])
    return Tokenizer(backend, special_tokens, chat_templates(meta), end_of_generation_ids(gguf), str(gguf.path))
