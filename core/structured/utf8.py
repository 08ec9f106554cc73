"""Keeps constrained output valid UTF-8 where xgrammar's byte matching is lenient.

xgrammar checks that a lead byte gets the right number of continuation bytes but accepts any
continuation after the leads whose second byte is restricted (overlong forms after E0 / F0,
UTF-16 surrogates after ED, code points past U+10FFFF after F4), and the bytes that never occur
in UTF-8 (C0, C1, F5-FF). Detokenized, such bytes become U+FFFD: the text would no longer be the
text the grammar accepted (a string over its maxLength, a pattern that no longer matches).

Tokens holding an impossible byte sequence are removed from the grammar vocabulary once
(``invalid_utf8_tokens``); a token that would start with a wrong second byte is masked per step
(``Utf8Guard``), which needs only the sequence's last output bytes.
"""
from __future__ import annotations

import torch

# lead byte -> the range its second byte must fall in (every other lead takes 80-BF)
_SECOND_BYTE = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}
_NEVER = frozenset([0xC0, 0xC1, *range(0xF5, 0x100)])


def _bad_inside(data: bytes) -> bool:
    """Whether ``data`` holds a byte that is never UTF-8 or a restricted lead with a wrong second byte."""
    for i, byte in enumerate(data):
        if byte in _NEVER:
            return True
        limits = _SECOND_BYTE.get(byte)
        if limits is not None and i + 1 < len(data) and not limits[0] <= data[i + 1] <= limits[1]:
            return True
    return False


def invalid_utf8_tokens(decoded_vocab: list[bytes]) -> list[int]:
    """Ids of tokens whose bytes can never be part of valid UTF-8 text."""
    return [i for i, data in enumerate(decoded_vocab) if data and _bad_inside(data)]


def pending_lead(tail: bytes) -> int | None:
    """The restricted lead byte ``tail`` ends with (its second byte still to come), else None."""
    if tail and tail[-1] in _SECOND_BYTE:
        return tail[-1]
    return None


class Utf8Guard:
    """Per restricted lead byte, the packed mask of tokens allowed to follow it.

    decoded_vocab: each token's bytes (xgrammar's ``TokenizerInfo.decoded_vocab``).
    """

    def __init__(self, decoded_vocab: list[bytes], vocab_size: int) -> None:
        self.decoded_vocab = decoded_vocab
        words = -(-vocab_size // 32)
        first = torch.full((words * 32,), -1, dtype=torch.int64)
        first[: len(decoded_vocab)] = torch.tensor([d[0] if d else -1 for d in decoded_vocab], dtype=torch.int64)
        weights = torch.ones(32, dtype=torch.int64) << torch.arange(32)  # bit j of a word
        self._keep: dict[int, torch.Tensor] = {}
        for lead, (low, high) in _SECOND_BYTE.items():
            wrong = (first >= 0x80) & (first <= 0xBF) & ((first < low) | (first > high))  # [32 * W]
            packed = ((~wrong).view(words, 32).long() * weights).sum(dim=1)  # [W] as uint32 values
            self._keep[lead] = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)

    def tail_bytes(self, output_token_ids: list[int]) -> bytes:
        """The last bytes of an output: enough tokens to cover a lead byte and its continuation."""
        return b"".join(self.decoded_vocab[t] for t in output_token_ids[-3:] if t < len(self.decoded_vocab))

    def restrict(self, bitmask_row: torch.Tensor, output_token_ids: list[int]) -> None:
        """bitmask_row: [W] int32, narrowed in place when the output ends in a restricted lead byte."""
        lead = pending_lead(self.tail_bytes(output_token_ids))
        if lead is not None:
            bitmask_row &= self._keep[lead]
