"""A step's grammar token mask and its application to the logits, in place, on the logits' device.

CUDA logits use xgrammar's Triton kernel (the mask travels through pinned memory, no host sync);
CPU logits a numpy bit unpack and one masked fill (several times faster there than xgrammar's CPU
kernel); other devices, and the tests' oracle, ``apply_token_bitmask_reference``.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
import torch

_BITS = 32  # xgrammar packs 32 tokens per int32 word: bit j of word w allows token 32 * w + j


@dataclass(slots=True)
class TokenBitmask:
    """The allowed next tokens of one step's constrained rows.

    bitmask: [B, ceil(V / 32)] int32 on the host, one row per sampled sequence (unconstrained rows unused)
    rows:    the constrained rows (indices into the logits' batch)
    """

    bitmask: torch.Tensor
    rows: list[int]
    valid_drafts: list[int] | None = None  # a verify step: per sequence, the drafts its grammar accepts

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [B, V]; sets the tokens the grammars forbid to -inf in place and returns it."""
        apply_token_bitmask(logits, self.bitmask, self.rows)
        return logits


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        # pinned memory makes the copy asynchronous instead of a stream synchronisation
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """logits: [B, V] float32; bitmask: [B, W] int32 on the host, W * 32 >= V; only ``rows`` are masked."""
    if bitmask.shape[1] * _BITS < logits.shape[1]:
        raise ValueError(f"a bitmask of {bitmask.shape[1]} words cannot cover {logits.shape[1]} logits")
    device = logits.device
    every_row = len(rows) == logits.shape[0]
    if device.type == "cpu" and sys.byteorder == "little":
        words = bitmask.numpy() if every_row else bitmask.numpy()[rows]
        # little-endian int32 words as bytes, least significant bit first: bit 32w + j is token 32w + j
        forbidden = np.unpackbits((~words).view(np.uint8), axis=1, bitorder="little")[:, :logits.shape[1]]
        forbidden = torch.from_numpy(forbidden.view(np.bool_))  # [R, V]
        if every_row:
            logits.masked_fill_(forbidden, float("-inf"))
        else:
            index = torch.tensor(rows, dtype=torch.int64)
            logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(forbidden, float("-inf")))
        return
    if device.type == "cuda" and logits.dtype == torch.float32:
        import xgrammar as xgr

        indices = None if every_row else _to_device(torch.tensor(rows, dtype=torch.int32), device)
        xgr.apply_token_bitmask_inplace(logits, _to_device(bitmask, device), vocab_size=logits.shape[1],
                                        indices=indices, backend="triton")
        return
    apply_token_bitmask_reference(logits, bitmask, rows)


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bitmask: [R, W] int32 -> allowed: [R, vocab] bool (tokens past 32 * W are forbidden)."""
    shifts = torch.arange(_BITS, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)  # [R, 32 * W]
    width = allowed.shape[1]
    if width >= vocab:
        return allowed[:, :vocab]
    pad = torch.zeros(allowed.shape[0], vocab - width, dtype=torch.bool, device=bitmask.device)
    return torch.cat([allowed, pad], dim=1)


def apply_token_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Plain torch on any device: the same result as ``apply_token_bitmask``, in place."""
    index = _to_device(torch.tensor(rows, dtype=torch.int64), logits.device)
    allowed = unpack_bitmask(_to_device(bitmask, logits.device).index_select(0, index), logits.shape[1])  # [R, V]
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill(~allowed, float("-inf")))
