"""Chunk tables for packed variable-length batches (conv1d, chunked GDN), built on the host from the sequence offsets.

Sequences in a packed tensor start anywhere, not at multiples of the chunk size, so chunked kernels
walk a table of (sequence, chunk-within-sequence) pairs instead of cutting the packed tensor.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class VarlenChunks:
    """``table``: [num_chunks, 2] int32 (sequence, chunk index inside it), sequence-major;
    ``first_chunk``: [B] int32 row of each sequence's first chunk in ``table``; both on the device."""

    table: torch.Tensor
    first_chunk: torch.Tensor
    num_chunks: int


def host_bounds(cu_seqlens: torch.Tensor | Sequence[int], cu_seqlens_cpu: Sequence[int] | None) -> list[int]:
    """Sequence offsets as host ints: ``cu_seqlens_cpu`` when given, else read back (a device sync)."""
    if cu_seqlens_cpu is not None:
        return [int(x) for x in cu_seqlens_cpu]
    if isinstance(cu_seqlens, torch.Tensor):
        return cu_seqlens.tolist()
    return [int(x) for x in cu_seqlens]


def device_offsets(cu_seqlens: torch.Tensor | Sequence[int], device: torch.device) -> torch.Tensor:
    """cu_seqlens as an int32 tensor on ``device`` (copied only when it is not one already)."""
    if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.device == device and cu_seqlens.dtype == torch.int32:
        return cu_seqlens
    return torch.as_tensor(cu_seqlens, dtype=torch.int32).to(device)


def varlen_chunks(bounds: Sequence[int], chunk_size: int, device: torch.device) -> VarlenChunks:
    """The chunk table of sequences ``bounds[i]..bounds[i+1]`` cut into ``chunk_size`` tokens each."""
    table: list[int] = []
    first: list[int] = []
    for seq in range(len(bounds) - 1):
        first.append(len(table) // 2)
        for chunk in range(-(-(bounds[seq + 1] - bounds[seq]) // chunk_size)):
            table += (seq, chunk)
    table_t = torch.tensor(table, dtype=torch.int32).reshape(-1, 2).to(device)
    first_t = torch.tensor(first, dtype=torch.int32).to(device)
    return VarlenChunks(table_t, first_t, len(table) // 2)
