"""Vectorised numpy dequantization of the common GGUF block types (F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0).

The gguf package dequantizes row group by row group in Python (2.9 s of SmolLM2's start-up on a
2-core box); these do one whole tensor in a few array operations. Layouts are ggml's: blocks of
32 values, an f16 scale ``d`` (and ``m`` for the _1 types) first, then the 4-bit quants, low
nibbles holding values 0-15 and high nibbles 16-31; Q5 types keep the fifth bits in a u32 ``qh``.
Other types return None (the caller falls back to the gguf package).
"""
from __future__ import annotations

import numpy as np
from gguf.constants import GGMLQuantizationType as T

_BLOCK = 32


def _f16(raw: np.ndarray, start: int) -> np.ndarray:
    """[blocks, 1] float32 from the f16 at byte ``start`` of every block row."""
    return raw[:, start:start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[blocks, 16] packed bytes -> [blocks, 32] 4-bit values (low nibbles first)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """[blocks, 4] little-endian u32 bytes -> [blocks, 32] bit j of it, shifted to 16."""
    bits = np.unpackbits(qh, axis=1, bitorder="little")  # [blocks, 32], bit j of the u32
    return bits << 4


def dequantize_fast(raw: np.ndarray, qtype: int) -> np.ndarray | None:
    """``raw``: the tensor's bytes (uint8, flat); float32 values, flat, or None for other types."""
    if qtype == T.F16:
        return raw.view(np.float16).astype(np.float32)
    if qtype == T.BF16:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    sizes = {T.Q4_0: 18, T.Q4_1: 20, T.Q5_0: 22, T.Q5_1: 24, T.Q8_0: 34}
    if qtype not in sizes:
        return None
    blocks = raw.reshape(-1, sizes[qtype])
    d = _f16(blocks, 0)
    if qtype == T.Q8_0:
        q = blocks[:, 2:].copy().view(np.int8).astype(np.float32)
        return (q * d).reshape(-1)
    if qtype == T.Q4_0:
        return ((_nibbles(blocks[:, 2:]).astype(np.float32) - 8.0) * d).reshape(-1)
    if qtype == T.Q4_1:
        return (_nibbles(blocks[:, 4:]).astype(np.float32) * d + _f16(blocks, 2)).reshape(-1)
    if qtype == T.Q5_0:
        q = _nibbles(blocks[:, 6:]) | _fifth_bits(blocks[:, 2:6])
        return ((q.astype(np.float32) - 16.0) * d).reshape(-1)
    q = _nibbles(blocks[:, 8:]) | _fifth_bits(blocks[:, 4:8])  # Q5_1
    return (q.astype(np.float32) * d + _f16(blocks, 2)).reshape(-1)
