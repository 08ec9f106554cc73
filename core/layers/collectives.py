"""The collectives the shared layers need: in-place sums over the tensor- or expert-parallel group, and a gather.

Size 1 is a no-op that returns its input (nothing is launched, nothing imported). Larger groups go
through ``torch.distributed`` (NCCL on GPUs, gloo on CPU): the worker that sets up the process
groups registers them with ``set_group("tp" | "ep", group)``; an unregistered kind uses the
default (world) group, which is right while one TP or EP group spans every process.
"""
from __future__ import annotations

from typing import Any

import torch

KINDS = ("tp", "ep")
_groups: dict[str, Any] = {}


def set_group(kind: str, group: Any) -> None:
    """Register the process group the ``kind`` collectives run over (None: the world group)."""
    if kind not in KINDS:
        raise ValueError(f"collective group kind must be one of {KINDS}, not {kind!r}")
    _groups[kind] = group


def all_reduce(x: torch.Tensor, size: int, kind: str = "tp") -> torch.Tensor:
    """Sum ``x`` in place over the ``kind`` group of ``size`` ranks; returns ``x``."""
    if size == 1:
        return x
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"a {kind} group of size {size} needs torch.distributed initialised before the forward")
    dist.all_reduce(x, group=_groups.get(kind))
    return x


def all_gather(x: torch.Tensor, size: int, kind: str = "tp") -> torch.Tensor:
    """Every rank's ``x`` of the ``kind`` group of ``size`` ranks, side by side along the last dim (rank order)."""
    if size == 1:
        return x
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"a {kind} group of size {size} needs torch.distributed initialised before the forward")
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=_groups.get(kind))
    return torch.cat(parts, dim=-1)
