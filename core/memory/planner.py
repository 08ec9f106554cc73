"""Sizes and allocates the KV block pool and the recurrent-state pool from a model's cache layout."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from armillary.cache_spec import FullAttention, LatentAttention, LayerCacheSpec, Recurrent
from armillary.forward_batch import KVCache, LatentCache, LayerCache, RecurrentState

log = logging.getLogger("armillary")
GiB = 1 << 30


@dataclass(slots=True)
class MemoryPlan:
    num_blocks: int
    block_size: int
    num_slots: int
    bytes_per_block: int  # summed over all paged layers
    bytes_per_slot: int  # summed over all recurrent layers

    def describe(self) -> str:
        kv = self.num_blocks * self.bytes_per_block / GiB
        st = self.num_slots * self.bytes_per_slot / GiB
        return (f"{self.num_blocks} KV blocks of {self.block_size} tokens ({kv:.2f} GiB), "
                f"{self.num_slots} state slots ({st:.2f} GiB)")


def bytes_per_block(layout: list[LayerCacheSpec | None], block_size: int, dtype: torch.dtype) -> int:
    return sum(s.bytes_per_token(dtype) * block_size for s in layout
               if isinstance(s, (FullAttention, LatentAttention)))


def bytes_per_slot(layout: list[LayerCacheSpec | None], dtype: torch.dtype) -> int:
    return sum(s.bytes_per_slot(dtype) for s in layout if isinstance(s, Recurrent))


def plan_memory(layout: list[LayerCacheSpec | None], *, budget_bytes: int, block_size: int, num_slots: int,
                dtype: torch.dtype, max_blocks_useful: int, num_blocks_override: int | None = None) -> MemoryPlan:
    """Slots first (one per running sequence), then as many KV blocks as the rest of the budget holds.

    ``max_blocks_useful`` caps the pool at what ``max_num_seqs`` full-length sequences could use.
    """
    per_block = bytes_per_block(layout, block_size, dtype)
    per_slot = bytes_per_slot(layout, dtype)
    if num_blocks_override is not None:
        num_blocks = num_blocks_override
    elif per_block == 0:
        num_blocks = max_blocks_useful  # no paged layer: block ids only track positions
    else:
        left = budget_bytes - num_slots * per_slot
        num_blocks = min(max_blocks_useful, left // per_block)
        if num_blocks < 1:
            need = (num_slots * per_slot + per_block) / GiB
            raise MemoryError(f"the cache budget ({budget_bytes / GiB:.2f} GiB) cannot hold {num_slots} state slots "
                              f"and one KV block ({need:.2f} GiB needed); lower --max-num-seqs or raise the budget")
    return MemoryPlan(num_blocks, block_size, num_slots, per_block, per_slot)


def allocate_caches(layout: list[LayerCacheSpec | None], plan: MemoryPlan, dtype: torch.dtype,
                    device: torch.device) -> tuple[list[LayerCache | None], list[torch.Tensor]]:
    """Per-layer cache objects plus the flat list of recurrent tensors (for the ``StatePool``)."""
    caches: list[LayerCache | None] = []
    state_tensors: list[torch.Tensor] = []
    nb, bs = plan.num_blocks, plan.block_size
    for spec in layout:
        if isinstance(spec, FullAttention):
            k = torch.zeros(nb, bs, spec.kv_heads, spec.head_dim, dtype=dtype, device=device)
            v = torch.zeros(nb, bs, spec.kv_heads, spec.v_head_dim or spec.head_dim, dtype=dtype, device=device)
            caches.append(KVCache(k, v))
        elif isinstance(spec, LatentAttention):
            caches.append(LatentCache(torch.zeros(nb, bs, spec.kv_lora_rank + spec.rope_dim, dtype=dtype, device=device)))
        elif isinstance(spec, Recurrent):
            ts = tuple(torch.zeros(plan.num_slots, *shape, dtype=dt or dtype, device=device)
                       for shape, dt in zip(spec.shapes, spec.dtypes))
            state_tensors.extend(ts)
            caches.append(RecurrentState(ts))
        elif spec is None:
            caches.append(None)
        else:
            raise TypeError(f"unknown cache spec {spec!r}")
    return caches, state_tensors


def cuda_cache_budget(device: torch.device, utilization: float) -> int:
    """Bytes left for caches: ``utilization`` of the GPU minus what weights and the warm-up peak used."""
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    stats = torch.cuda.memory_stats(device)
    peak_extra = stats["allocated_bytes.all.peak"] - stats["allocated_bytes.all.current"]
    return int(total * utilization - used - peak_extra)
