"""Cache groups from a model's cache layout; the pools sized from a byte budget; the tensors allocated.

Paged layers are grouped by spec (full attention, each sliding window, MLA latent). All paged
groups draw block ids from one pool. With one group, block ``b`` is page ``b`` of every layer's
tensor. With several (Gemma's 5 sliding : 1 global), each group is split into subgroups of the
same number of layers ``P`` (the smallest group's count), and layer ``j`` of every subgroup
shares storage tensor ``j``: a block id is one page at each of the ``P`` storage positions, used
by whichever subgroup holds it. So a sliding-window block that returns to the pool is memory any
group can reuse, and no group reserves memory it does not use (vLLM's hybrid allocator, smaller).
Groups whose pages differ (Gemma 4: global layers with another head_dim and kv heads than the
sliding ones) share storage by bytes: a block id is the same number of bytes at every position,
the largest layer page; a group with smaller pages packs ``unit // page`` layers into one position
(the position's page holds their pages side by side), so K/V views stride by the position's page.
Recurrent layers keep one row per state slot in a single flat buffer, so a snapshot of a slot
(every recurrent layer at once) is one device copy.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from armillary.cache_spec import FullAttention, LatentAttention, LayerCacheSpec, Recurrent, SlidingWindow
from armillary.forward_batch import KVCache, LatentCache, LayerCache, RecurrentState
from armillary.memory.state_pool import StatePool

log = logging.getLogger("armillary")
GiB = 1 << 30
_ALIGN = 256  # bytes: each layer's state view starts aligned inside a slot's row


@dataclass(slots=True)
class PagedGroupPlan:
    """Layers (cache_layout indices) of one paged group; layer ``layers[j]`` uses storage position ``j``."""

    spec: FullAttention | LatentAttention
    layers: tuple[int, ...]
    per_position: int = 1  # layers packed into one storage position (pages smaller than the position's)

    @property
    def window(self) -> int | None:
        return self.spec.window if isinstance(self.spec, SlidingWindow) else None

    @property
    def num_positions(self) -> int:
        return -(-len(self.layers) // self.per_position)

    def position_of(self, j: int) -> tuple[int, int]:
        """(storage position, page index inside it) of ``layers[j]``."""
        return divmod(j, self.per_position)


@dataclass(slots=True)
class MemoryPlan:
    num_blocks: int  # block ids, the reserved scratch block included
    block_size: int
    num_slots: int  # state slots, the scratch slot included
    bytes_per_block: int  # one block id at every storage position
    bytes_per_slot: int  # one slot's row: every recurrent layer's states
    paged_groups: list[PagedGroupPlan] = field(default_factory=list)
    recurrent_layers: tuple[int, ...] = ()
    num_snapshots: int = 0  # extra state rows for snapshots
    num_spec_rows: int = 0  # speculation: K rows per slot for the states after each verified position

    @property
    def num_state_rows(self) -> int:
        return self.num_slots + self.num_snapshots + self.num_spec_rows

    def spec_row(self, slot: int, i: int) -> int:
        """The row holding slot ``slot``'s state after verified position ``i`` (< K) of a draft chunk."""
        return self.num_slots + self.num_snapshots + slot * (self.num_spec_rows // self.num_slots) + i

    @property
    def num_positions(self) -> int:
        return max((g.num_positions for g in self.paged_groups), default=0)

    @property
    def uniform_pages(self) -> bool:
        """One page shape in every paged group: each position is a contiguous K and V tensor pair."""
        first = _page_shape(self.paged_groups[0].spec, None)
        return all(g.per_position == 1 and _page_shape(g.spec, None) == first for g in self.paged_groups)

    def describe(self) -> str:
        kv = self.num_blocks * self.bytes_per_block / GiB
        rows = self.num_state_rows
        st = rows * self.bytes_per_slot / GiB
        groups = ", ".join(f"{type(g.spec).__name__}×{len(g.layers)}" + (f" w{g.window}" if g.window else "")
                           for g in self.paged_groups)
        return (f"{self.num_blocks} KV blocks of {self.block_size} tokens ({kv:.2f} GiB; groups: {groups or 'none'}), "
                f"{self.num_slots} state slots + {self.num_snapshots} snapshots"
                + (f" + {self.num_spec_rows} speculation rows" if self.num_spec_rows else "") + f" ({st:.2f} GiB)")


def _page_shape(spec: FullAttention | LatentAttention, dtype: torch.dtype | None) -> tuple:
    """What one layer's page looks like (dtype None: the spec's own kv_dtype, None meaning the model's)."""
    cdt = spec.kv_dtype if dtype is None else spec.cache_dtype(dtype)
    if isinstance(spec, LatentAttention):
        return ("latent", spec.kv_lora_rank + spec.rope_dim, cdt)
    return ("kv", spec.kv_heads, spec.head_dim, spec.v_head_dim or spec.head_dim, cdt, spec.scaled)


def group_layers(layout: list[LayerCacheSpec | None], dtype: torch.dtype
                 ) -> tuple[list[PagedGroupPlan], tuple[int, ...]]:
    """Paged groups (split to equal storage-position counts when there are several, smaller pages packed
    ``per_position`` to a position) and the recurrent layers."""
    buckets: dict[LayerCacheSpec, list[int]] = {}
    recurrent: list[int] = []
    for i, spec in enumerate(layout):
        if isinstance(spec, (FullAttention, LatentAttention)):
            buckets.setdefault(spec, []).append(i)
        elif isinstance(spec, Recurrent):
            recurrent.append(i)
        elif spec is not None:
            raise TypeError(f"unknown cache spec {spec!r}")
    if not buckets:
        return [], tuple(recurrent)
    # pages of one shape fill a position alone; smaller pages pack several layers into it
    unit = max(s.bytes_per_token(dtype) for s in buckets)
    packing = {s: (1 if len({_page_shape(b, dtype) for b in buckets}) == 1 else unit // s.bytes_per_token(dtype))
               for s in buckets}
    per = min(-(-len(layers) // packing[s]) for s, layers in buckets.items())  # positions per subgroup
    groups = [PagedGroupPlan(spec, tuple(layers[i:i + per * packing[spec]]), packing[spec])
              for spec, layers in buckets.items() for i in range(0, len(layers), per * packing[spec])]
    return groups, tuple(recurrent)


def blocks_per_sequence(groups: list[PagedGroupPlan], block_size: int, max_model_len: int,
                        max_chunk: int) -> int:
    """Blocks one sequence of ``max_model_len`` tokens may hold at once, over all paged groups."""
    full = -(-max_model_len // block_size)
    total = 0
    for g in groups:
        if g.window:  # the window behind the chunk's first query, the chunk, one partly stale block
            total += min(full, -(-(g.window + max_chunk) // block_size) + 1)
        else:
            total += full
    return total


def bytes_per_slot(layout: list[LayerCacheSpec | None], dtype: torch.dtype) -> int:
    return sum(_state_offsets(layout, dtype)[1])


def _state_offsets(layout: list[LayerCacheSpec | None], dtype: torch.dtype) -> tuple[list[int], list[int]]:
    """Byte offset and padded size of every recurrent state tensor inside one slot's row."""
    offsets, sizes, at = [], [], 0
    for spec in layout:
        if isinstance(spec, Recurrent):
            for shape, dt in zip(spec.shapes, spec.dtypes):
                n = torch.Size(shape).numel() * _size(dt or dtype)
                padded = -(-n // _ALIGN) * _ALIGN
                offsets.append(at)
                sizes.append(padded)
                at += padded
    return offsets, sizes


def plan_memory(layout: list[LayerCacheSpec | None], *, budget_bytes: int, block_size: int, num_slots: int,
                dtype: torch.dtype, max_model_len: int, max_num_seqs: int, max_chunk: int,
                num_blocks_override: int | None = None, num_snapshots: int = 0,
                spec_rows_per_slot: int = 0) -> MemoryPlan:
    """State rows first (a slot per running sequence, the snapshots), then as many blocks as the rest holds.

    The pool is capped at what ``max_num_seqs`` sequences of ``max_model_len`` could hold and must
    hold at least one such sequence. Block id 0 and the last slot are scratch space (never handed out).
    """
    groups, recurrent = group_layers(layout, dtype)
    page = max((g.spec.bytes_per_token(dtype) for g in groups), default=0) * block_size  # one position's block
    per_block = page * max((g.num_positions for g in groups), default=0)
    per_slot = bytes_per_slot(layout, dtype)
    num_spec_rows = num_slots * spec_rows_per_slot if recurrent else 0
    state_rows = num_slots + num_snapshots + num_spec_rows
    per_seq = blocks_per_sequence(groups, block_size, max_model_len, max_chunk)
    useful = max_num_seqs * per_seq + 1  # + the scratch block
    if num_blocks_override is not None:
        num_blocks = num_blocks_override
    elif per_block == 0:
        num_blocks = 1  # no paged layer: only the scratch block
    else:
        left = budget_bytes - state_rows * per_slot
        num_blocks = min(useful, max(0, left) // per_block)
        if num_blocks - 1 < per_seq:
            need = (state_rows * per_slot + (per_seq + 1) * per_block) / GiB
            raise MemoryError(
                f"the cache budget ({budget_bytes / GiB:.2f} GiB) cannot hold one sequence of max_model_len "
                f"{max_model_len} tokens and {num_slots - 1} state slots ({need:.2f} GiB needed); lower "
                "--max-model-len or --max-num-seqs, or raise --gpu-memory-utilization / the CPU cache space")
    return MemoryPlan(num_blocks, block_size, num_slots, per_block, per_slot, groups, recurrent, num_snapshots,
                      num_spec_rows)


def allocate_caches(layout: list[LayerCacheSpec | None], plan: MemoryPlan, dtype: torch.dtype,
                    device: torch.device) -> tuple[list[LayerCache | None], StatePool | None]:
    """Per-layer cache objects (indexed like ``layout``) and the recurrent ``StatePool``.

    Every pool starts zeroed (kernels may read, masked, slots never written). On the CPU the
    zeros come from calloc, whose large blocks are the OS's zero pages committed on first
    touch: memory is taken as sequences use it, not at start-up.
    """
    def new(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if device.type == "cuda":
            return torch.zeros(*shape, dtype=dtype, device=device)
        nbytes = torch.Size(shape).numel() * _size(dtype)
        return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(*shape)

    caches: list[LayerCache | None] = [None] * len(layout)
    if plan.paged_groups and not plan.uniform_pages:
        _allocate_byte_pages(plan, dtype, device, caches, new)
        return caches, _state_pool(layout, plan, dtype, device, caches, new)
    nb, bs = plan.num_blocks, plan.block_size
    storage: list[tuple[torch.Tensor, ...]] = []
    spec0 = plan.paged_groups[0].spec if plan.paged_groups else None
    for _ in range(plan.num_positions):
        if isinstance(spec0, LatentAttention):
            storage.append((new(nb, bs, spec0.kv_lora_rank + spec0.rope_dim, dtype=spec0.cache_dtype(dtype),
                                device=device),))
        else:
            kv_dtype = spec0.cache_dtype(dtype)
            storage.append((new(nb, bs, spec0.kv_heads, spec0.head_dim, dtype=kv_dtype, device=device),
                            new(nb, bs, spec0.kv_heads, spec0.v_head_dim or spec0.head_dim, dtype=kv_dtype,
                                device=device)))
    for gid, group in enumerate(plan.paged_groups):
        for j, layer in enumerate(group.layers):
            if isinstance(group.spec, LatentAttention):
                caches[layer] = LatentCache(storage[j][0], group=gid)
            else:
                scales = (torch.ones((), dtype=torch.float32, device=device),
                          torch.ones((), dtype=torch.float32, device=device)) if group.spec.scaled else (None, None)
                caches[layer] = KVCache(storage[j][0], storage[j][1], gid, *scales)
    for t in storage:  # the scratch block: read (masked) by padding rows and stale window entries
        for x in t:
            x[0].zero_()
    return caches, _state_pool(layout, plan, dtype, device, caches, new)


def _scales(spec: FullAttention, device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if not spec.scaled:
        return None, None
    return torch.ones((), dtype=torch.float32, device=device), torch.ones((), dtype=torch.float32, device=device)


def _allocate_byte_pages(plan: MemoryPlan, dtype: torch.dtype, device: torch.device,
                         caches: list[LayerCache | None], new) -> None:
    """Paged groups of several page shapes: one byte tensor ``[num_blocks, position page]`` per position;
    each layer's K / V (or latent) is a strided view of its page's bytes, block stride = the position page."""
    nb, bs = plan.num_blocks, plan.block_size
    unit = max(g.spec.bytes_per_token(dtype) for g in plan.paged_groups) * bs
    storage = [new(nb, unit, dtype=torch.uint8, device=device) for _ in range(plan.num_positions)]
    for gid, group in enumerate(plan.paged_groups):
        spec = group.spec
        page = spec.bytes_per_token(dtype) * bs
        cdt = spec.cache_dtype(dtype)
        for j, layer in enumerate(group.layers):
            position, index = group.position_of(j)
            at = index * page

            def view(offset: int, *shape: int, _s=storage[position], _cdt=cdt) -> torch.Tensor:
                n = bs * torch.Size(shape).numel() * _size(_cdt)
                return _s[:, offset:offset + n].view(_cdt).view(nb, bs, *shape)  # [nb, bs, *shape], block-strided

            if isinstance(spec, LatentAttention):
                caches[layer] = LatentCache(view(at, spec.kv_lora_rank + spec.rope_dim), group=gid)
                continue
            k = view(at, spec.kv_heads, spec.head_dim)
            v = view(at + k[0].numel() * _size(cdt), spec.kv_heads, spec.v_head_dim or spec.head_dim)
            caches[layer] = KVCache(k, v, gid, *_scales(spec, device))
    for x in storage:  # the scratch block: read (masked) by padding rows and stale window entries
        x[0].zero_()


def _state_pool(layout: list[LayerCacheSpec | None], plan: MemoryPlan, dtype: torch.dtype, device: torch.device,
                caches: list[LayerCache | None], new) -> StatePool | None:
    """The recurrent layers' rows (one flat buffer) and their per-layer views into ``caches``."""
    pool = None
    if plan.recurrent_layers:
        rows = plan.num_state_rows
        buffer = new(rows, plan.bytes_per_slot, dtype=torch.uint8, device=device)
        offsets, _ = _state_offsets(layout, dtype)
        k = 0
        for i in plan.recurrent_layers:
            spec = layout[i]
            views = []
            for shape, dt in zip(spec.shapes, spec.dtypes):
                n = torch.Size(shape).numel() * _size(dt or dtype)
                views.append(buffer[:, offsets[k]:offsets[k] + n].view(dt or dtype).view(rows, *shape))
                k += 1
            caches[i] = RecurrentState(tuple(views))
        pool = StatePool(buffer)
    return pool


def auto_snapshot_rows(budget_bytes: int, bytes_per_slot: int, max_num_seqs: int, max_model_len: int,
                       checkpoint_interval: int, fraction: float = 0.1) -> int:
    """Snapshot rows for prefix caching on a hybrid model when none are configured: ``fraction`` of
    the cache budget, no more than every sequence's checkpoints and end state could use, at least 2."""
    useful = max_num_seqs * (max_model_len // checkpoint_interval + 2)
    return max(2, min(useful, int(budget_bytes * fraction) // bytes_per_slot))


def cuda_cache_budget(device: torch.device, utilization: float) -> int:
    """Bytes left for caches: ``utilization`` of the GPU minus what weights and the warm-up peak used."""
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    stats = torch.cuda.memory_stats(device)
    peak_extra = stats["allocated_bytes.all.peak"] - stats["allocated_bytes.all.current"]
    return int(total * utilization - used - peak_extra)


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
