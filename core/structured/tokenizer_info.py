"""xgrammar's ``TokenizerInfo`` from the checkpoint's ``tokenizers`` backend (no transformers call).

The token mask covers the model's vocabulary (the lm_head's rows), which may be larger than the
tokenizer's (padding) or smaller (tokens the model never writes). Special tokens (the ones
``skip_special_tokens`` drops from text) are given no text, so a grammar never picks one: the
detokenized output always holds exactly the text the grammar accepted; so are tokens whose bytes
can never be UTF-8. The stop tokens end the grammar.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any

import xgrammar as xgr

from armillary.structured.utf8 import invalid_utf8_tokens


@lru_cache(maxsize=1)
def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as the printable character byte-level vocabularies store."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _encode_added(content: str, vocab_type: xgr.VocabType) -> str:
    """An added token's raw text in the vocabulary's stored form (added tokens are stored raw)."""
    if vocab_type is xgr.VocabType.BYTE_LEVEL:
        table = _byte_to_unicode()
        return "".join(table[b] for b in content.encode("utf-8"))
    if vocab_type is xgr.VocabType.BYTE_FALLBACK:
        return content.replace(" ", "\u2581")
    return content


def vocab_metadata(backend: Any) -> tuple[xgr.VocabType, bool]:
    """(vocabulary encoding, whether the tokenizer prepends a space) read from tokenizer.json.

    Uses xgrammar's own reader of the serialized ``tokenizers`` JSON, the one its Hugging Face
    constructor applies to fast tokenizers, so both paths agree.
    """
    found = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    return xgr.VocabType(found["vocab_type"]), bool(found["add_prefix_space"])


def build_tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...]) -> xgr.TokenizerInfo:
    """``tokenizer``: armillary's ``Tokenizer``; ``vocab_size``: the model's (the mask width)."""
    backend = tokenizer.backend
    vocab_type, add_prefix_space = vocab_metadata(backend)
    encoded = [""] * vocab_size  # "": no text, so never allowed by a grammar
    for token, token_id in backend.get_vocab(with_added_tokens=True).items():
        if token_id < vocab_size:
            encoded[token_id] = token
    for token_id, added in backend.get_added_tokens_decoder().items():
        if token_id < vocab_size:
            encoded[token_id] = "" if added.special else _encode_added(added.content, vocab_type)
    stops = [t for t in stop_token_ids if 0 <= t < vocab_size]

    def make() -> xgr.TokenizerInfo:
        return xgr.TokenizerInfo(encoded, vocab_type, vocab_size=vocab_size, stop_token_ids=stops or None,
                                 add_prefix_space=add_prefix_space)

    info = make()
    invalid = [i for i in invalid_utf8_tokens(info.decoded_vocab) if i not in stops]
    if not invalid:
        return info
    for token_id in invalid:  # bytes that never occur in UTF-8 text: no grammar may pick them
        encoded[token_id] = ""
    return make()
