"""Chunk tables for packed variable-length batches (conv1d, chunked GDN), built on the host from the sequence offsets.

Sequences in a packed tensor start anywhere, not at multiples of the chunk size, so chunked kernels
walk a table of (sequence, chunk-within-sequence) pairs instead of cutting the packed tensor.
"""
from __future__ import annotations

from collections import OrderedDict
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


_CHUNKS: OrderedDict[tuple, VarlenChunks] = OrderedDict()  # every layer of a step asks for the same tables
_CHUNKS_KEPT = 64


def varlen_chunks(bounds: Sequence[int], chunk_size: int, device: torch.device) -> VarlenChunks:
    """The chunk table of sequences ``bounds[i]..bounds[i+1]`` cut into ``chunk_size`` tokens each.

    Built once per distinct (bounds, chunk size, device) and kept (LRU, read-only tensors): a prefill's
    layers all ask for the same table, and a pageable host-to-device copy per layer would stall the
    stream each time. The copy goes through pinned memory, so it does not wait either."""
    key = (tuple(int(b) for b in bounds), chunk_size, device)
    hit = _CHUNKS.get(key)
    if hit is not None:
        _CHUNKS.move_to_end(key)
        return hit
    table: list[int] = []
    first: list[int] = []
    for seq in range(len(key[0]) - 1):
        first.append(len(table) // 2)
        for chunk in range(-(-(key[0][seq + 1] - key[0][seq]) // chunk_size)):
            table += (seq, chunk)
    host = torch.tensor(table + first, dtype=torch.int32)
    if device.type == "cuda":
        both = host.pin_memory().to(device, non_blocking=True)
    else:
        both = host.to(device)
    chunks = VarlenChunks(both[:len(table)].view(-1, 2), both[len(table):], len(table) // 2)
    _CHUNKS[key] = chunks
    if len(_CHUNKS) > _CHUNKS_KEPT:
        _CHUNKS.popitem(last=False)
    return chunks
