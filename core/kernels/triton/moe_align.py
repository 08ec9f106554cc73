"""Sort (token, slot) pairs by expert into BLOCK_M-row blocks, on the device, without a host sync.

Two launches after a memset: per-pair ranks inside each expert from atomics, then a scatter that
also maps every block to its expert. The block count is bounded on the host from shapes alone,
so a grouped GEMM can launch a worst-case grid and be captured in a CUDA graph. Few pairs (a decode
batch's, up to the ``moe_align`` table entry's ``one_program_max_pairs``) can take one launch instead:
a single program runs the memset, the ranks, the offsets and the scatter as phases between barriers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from armillary.kernels.triton.host import cdiv, next_power_of_2
from armillary.kernels.tuning import kernel_config

ONE_PROGRAM_DEFAULTS = {"one_program_max_pairs": 0, "num_warps": 8}  # off where no table measured it (sm_90: on)
ONE_PROGRAM_LIMIT = 2048  # pairs one program holds in registers (8 a thread at 8 warps)


@dataclass(slots=True)
class MoeAlignment:
    """Pairs (pair = token * top_k + slot) grouped by expert, each expert padded to BLOCK_M rows.

    sorted_pair_ids: [max_blocks * block_m] int32, the pair behind each row (padding rows are left
    unwritten: a row is real iff row < expert_offsets[e] + expert_counts[e]);
    block_expert: [max_blocks] int32, the expert of each block, -1 for blocks past the end;
    expert_offsets: [E + 1] int32, first padded row of each expert, [E] = rows in use;
    expert_counts: [E] int32, pairs routed to each expert.
    """

    sorted_pair_ids: torch.Tensor
    block_expert: torch.Tensor
    expert_offsets: torch.Tensor
    expert_counts: torch.Tensor
    block_m: int
    max_blocks: int


def max_aligned_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Most blocks any routing of ``num_pairs`` pairs can need: sum over used experts of ceil(c_e / M)."""
    used = min(num_pairs, num_experts)
    return max(1, (num_pairs + used * (block_m - 1)) // block_m)


@triton.jit
def _count_and_rank_kernel(ids_ptr, counts_ptr, rank_ptr, num_pairs, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < num_pairs
    expert = tl.load(ids_ptr + offs, mask=in_range, other=0)
    # the old count is this pair's rank inside its expert; the order among equal experts is arbitrary
    rank = tl.atomic_add(counts_ptr + expert, 1, mask=in_range)
    tl.store(rank_ptr + offs, rank, mask=in_range)


@triton.jit
def _scatter_kernel(
    ids_ptr,
    counts_ptr,
    rank_ptr,
    sorted_ptr,
    block_expert_ptr,
    offsets_ptr,
    num_pairs,
    num_experts,
    max_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    pid = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + experts, mask=experts < num_experts, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pad_end = tl.cumsum(padded, axis=0)  # [BLOCK_E]
    pad_start = pad_end - padded
    rows_used = tl.sum(padded, axis=0)
    if pid == 0:
        tl.store(offsets_ptr + experts, pad_start, mask=experts < num_experts)
        tl.store(offsets_ptr + num_experts, rows_used)

    offs = pid * BLOCK + tl.arange(0, BLOCK)
    pair_ok = offs < num_pairs
    expert = tl.load(ids_ptr + offs, mask=pair_ok, other=0)
    rank = tl.load(rank_ptr + offs, mask=pair_ok, other=0)
    # pad_start[expert] looked up by a one-hot reduction over the (at most a few hundred) experts
    start = tl.sum(tl.where(expert[:, None] == experts[None, :], pad_start[None, :], 0), axis=1)  # [BLOCK]
    tl.store(sorted_ptr + start + rank, offs, mask=pair_ok)

    first_row = offs * BLOCK_M  # blocks handled by this program: the same index range
    owner = tl.sum(((pad_end[None, :] <= first_row[:, None]) & (experts[None, :] < num_experts)).to(tl.int32), axis=1)
    owner = tl.where(first_row < rows_used, owner, -1)
    tl.store(block_expert_ptr + offs, owner, mask=offs < max_blocks)


@triton.jit
def _align_one_program_kernel(ids_ptr, counts_ptr, sorted_ptr, block_expert_ptr, offsets_ptr, num_pairs, num_experts,
                              max_blocks, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr,
                              BLOCK_B: tl.constexpr):
    """Grid (1,): ``moe_align``'s result for at most BLOCK_P pairs. Phases, a barrier apart: counts zeroed and
    every block marked unused; ranks from atomics; padded offsets from the counts; each pair stored at its row,
    and the pair opening a block names that block's expert. Reads of what the phase before wrote skip L1."""
    experts = tl.arange(0, BLOCK_E)
    e_ok = experts < num_experts
    tl.store(counts_ptr + experts, tl.zeros([BLOCK_E], dtype=tl.int32), mask=e_ok)
    for b0 in range(0, max_blocks, BLOCK_B):
        blocks = b0 + tl.arange(0, BLOCK_B)
        tl.store(block_expert_ptr + blocks, tl.full([BLOCK_B], -1, dtype=tl.int32), mask=blocks < max_blocks)
    tl.debug_barrier()
    offs = tl.arange(0, BLOCK_P)
    pair_ok = offs < num_pairs
    expert = tl.load(ids_ptr + offs, mask=pair_ok, other=0).to(tl.int32)
    rank = tl.atomic_add(counts_ptr + expert, 1, mask=pair_ok)  # the order among equal experts is arbitrary
    tl.debug_barrier()
    counts = tl.load(counts_ptr + experts, mask=e_ok, other=0, cache_modifier=".cg")
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pad_end = tl.cumsum(padded, axis=0)  # [BLOCK_E]
    tl.store(offsets_ptr + experts, pad_end - padded, mask=e_ok)
    tl.store(offsets_ptr + num_experts, tl.sum(padded, axis=0))
    tl.debug_barrier()
    row = tl.load(offsets_ptr + expert, mask=pair_ok, other=0, cache_modifier=".cg") + rank  # [BLOCK_P]
    tl.store(sorted_ptr + row, offs, mask=pair_ok)
    tl.store(block_expert_ptr + row // BLOCK_M, expert, mask=pair_ok & (rank % BLOCK_M == 0))


def one_program_config(device: torch.device) -> dict:
    """``one_program_max_pairs`` (0: never) and warps of the one-launch path: defaults, then the tables."""
    return kernel_config("armillary.kernels", "moe_align", "default", ONE_PROGRAM_DEFAULTS, device)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int, one_program: bool | None = None) -> MoeAlignment:
    """Group the pairs of ``topk_ids`` ([T, k], int32 or int64, values < num_experts) by expert.

    ``one_program``: force (True) or forbid (False) the one-launch path; None: the table decides by pair count."""
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    num_pairs = ids.numel()
    device = ids.device
    max_blocks = max_aligned_blocks(num_pairs, num_experts, block_m)
    sorted_pair_ids = torch.empty(max_blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=device)
    offsets = torch.empty(num_experts + 1, dtype=torch.int32, device=device)
    cfg = one_program_config(device) if one_program is not False else ONE_PROGRAM_DEFAULTS
    if one_program is None:
        one_program = 0 < num_pairs <= min(cfg["one_program_max_pairs"], ONE_PROGRAM_LIMIT)
    if one_program:
        if not 0 < num_pairs <= ONE_PROGRAM_LIMIT:
            raise ValueError(f"moe_align: one program takes 1..{ONE_PROGRAM_LIMIT} pairs, not {num_pairs}")
        counts = torch.empty(num_experts, dtype=torch.int32, device=device)
        _align_one_program_kernel[(1,)](ids, counts, sorted_pair_ids, block_expert, offsets, num_pairs, num_experts,
                                        max_blocks, BLOCK_M=block_m, BLOCK_P=next_power_of_2(num_pairs),
                                        BLOCK_E=next_power_of_2(num_experts), BLOCK_B=256, num_warps=cfg["num_warps"])
        return MoeAlignment(sorted_pair_ids, block_expert, offsets, counts, block_m, max_blocks)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    rank = torch.empty(num_pairs, dtype=torch.int32, device=device)
    count_block = 256
    _count_and_rank_kernel[(cdiv(num_pairs, count_block),)](ids, counts, rank, num_pairs, BLOCK=count_block)
    block_e = next_power_of_2(num_experts)
    scatter_block = max(16, min(128, 8192 // block_e))  # keeps the one-hot tile near 8K elements
    grid = (cdiv(max(num_pairs, max_blocks), scatter_block),)
    _scatter_kernel[grid](
        ids,
        counts,
        rank,
        sorted_pair_ids,
        block_expert,
        offsets,
        num_pairs,
        num_experts,
        max_blocks,
        BLOCK_M=block_m,
        BLOCK=scatter_block,
        BLOCK_E=block_e,
        num_warps=4,
    )
    return MoeAlignment(sorted_pair_ids, block_expert, offsets, counts, block_m, max_blocks)
