"""FP8 grouped MoE GEMMs for prefill over expert-sorted rows, and their launch configs.

Rows are sorted by expert into BLOCK_M blocks (``moe_align``); a GEMM's input is e4m3 rows with a
scale per row and 128-column group (``fp8_gemm.quantize_act``), and the tiles multiply on the fp8
tensor cores with ``acc += dot · a_scale · w_scale`` per K step, loads pipelined through shared memory
(the expert tiles through a TMA descriptor on a GPU: ``use_tma``). Rows per tile, each GEMM's tile width,
warps, stages, GROUP_M swizzle and TMA come from the "fp8_moe_grouped" tuning entry (keyed by experts,
hidden, intermediate, top-k and rows per expert; ``bench/fp8_moe_grouped_sweep.py`` measures it); BLOCK_K
is the 128-column scale group. (An up GEMM that quantized act(gate) · up in its epilogue, so h [P, 2I] is
never written, was bit-equal but slower on the H200 at every size: bench/RESULTS.md, 2026-12-04.)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from armillary.kernels import tuning
from armillary.kernels.triton.fp8_gemm import act_group
from armillary.kernels.triton.fp8_skinny import on_gpu
from armillary.kernels.triton.host import cdiv

try:  # host-built TMA descriptors (Triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # an older Triton: the pointer loads only
    TensorDescriptor = None

TUNING_PACKAGE = "armillary.kernels"
GROUPED_KERNEL = "fp8_moe_grouped"
VARIANTS = ("grouped", "dequant")  # the grouped entry's "variant": the fp8 tile kernel, or unpacked experts
GROUPED_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # avg rows per expert; finer than bf16's (64 streams: r4,
# their 2-token verify steps: r8). Keys per GEMM, suffix 1 up / 2 down; GROUP_M 0: grid (blocks, N tiles), > 0:
# that many expert-sorted blocks walk the N tiles together (a 1-D grid)
_GROUPED_TILE_KEYS = ("BLOCK_N", "num_warps", "num_stages", "GROUP_M")


@triton.jit
def _grouped_kernel(
    a_ptr, as_ptr, w_ptr, s_ptr, out_ptr, sorted_ptr, block_expert_ptr, offsets_ptr, counts_ptr, A_ROWS, N, K,
    stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_om,
    A_DIV: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, ROWS_SHARE: tl.constexpr,
    EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, W_TMA: tl.constexpr,
):  # fmt: skip
    """Grid (max_blocks, cdiv(N, BN)), or (max_blocks · cdiv(N, BN),) with GROUP_M > 0: rows of
    expert-sorted block ``pid_m``; input row pair // A_DIV of the e4m3 a [A_ROWS, K] with scales as
    [cdiv(K, BK), A_ROWS]; output row = pair. ``W_TMA``: ``w_ptr`` is a [E · N, K] tensor descriptor with
    [BN, BK] blocks (TMA loads on sm_90; K whole BK tiles; rows past an expert's N are the next expert's,
    which only the masked output columns see)."""
    if GROUP_M > 0:  # GROUP_M consecutive blocks (mostly one expert) share their a rows across the N tiles in L2
        pid, n_tiles = tl.program_id(0), tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * n_tiles
        first = (pid // per_group) * GROUP_M
        group_rows = tl.minimum(tl.num_programs(0) // n_tiles - first, GROUP_M)
        pid_m = first + (pid % per_group) % group_rows
        pid_n = (pid % per_group) // group_rows
    else:
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m)
    if e < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < tl.load(offsets_ptr + e) + tl.load(counts_ptr + e)
    pair = tl.load(sorted_ptr + rows, mask=row_ok, other=0).to(tl.int64)  # padding rows read row 0
    src = pair // A_DIV
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = offs_n % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + src[:, None] * stride_am + offs_k[None, :]  # [BM, BK]
    s_base = s_ptr + e.to(tl.int64) * stride_se
    if W_TMA:
        w_row = e * N + pid_n * BLOCK_N
    else:
        w_ptrs = w_ptr + e.to(tl.int64) * stride_we + cols[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    row_blk = (pid_n * BLOCK_N) // GROUP_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(0, tl.cdiv(K, BLOCK_K)):
        k0 = kt * BLOCK_K
        if W_TMA:
            a = tl.load(a_ptrs)
            w = w_ptr.load([w_row, k0]).T  # [BK, BN], K-major as the fp8 wgmma wants
        elif EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        a_s = tl.load(as_ptr + kt * A_ROWS + src)  # [BM]
        if ROWS_SHARE:
            w_s = tl.load(s_base + row_blk * stride_sn + (k0 // GROUP_K) * stride_sk)
            acc += tl.dot(a, w) * (a_s[:, None] * w_s)
        else:
            w_s = tl.load(s_base + (cols // GROUP_N) * stride_sn + (k0 // GROUP_K) * stride_sk)  # [BN]
            acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
        a_ptrs += BLOCK_K
        if not W_TMA:
            w_ptrs += BLOCK_K
    dst = out_ptr + pair[:, None] * stride_om + offs_n[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n < N)[None, :])


def _grouped_gemm(aq: torch.Tensor, a_s: torch.Tensor, w: torch.Tensor, s: torch.Tensor, block_n: int, block_k: int,
                  a_div: int, num_pairs: int, align, out_dtype: torch.dtype, tile: dict) -> torch.Tensor:
    """Per-pair rows [pairs, N] of ``a[pair // a_div] @ (w[e] · s[e]).T`` from a's e4m3 rows ``aq`` and their
    group scales ``a_s`` (quantize_act's); ``tile``: BLOCK_N, num_warps, num_stages, GROUP_M of this launch,
    and TMA (None: ``use_tma``'s rule)."""
    e, n, k = w.shape
    group = act_group(k, block_k)
    out = torch.empty(num_pairs, n, dtype=out_dtype, device=aq.device)
    bn, group_m = tile["BLOCK_N"], tile["GROUP_M"]
    blocks, n_tiles = align.block_expert.shape[0], cdiv(n, bn)
    tma = use_tma(w, group, tile.get("TMA"))
    w_arg = TensorDescriptor.from_tensor(w.view(e * n, k), [bn, group]) if tma else w
    _grouped_kernel[(blocks * n_tiles,) if group_m > 0 else (blocks, n_tiles)](
        aq, a_s, w_arg, s, out, align.sorted_pair_ids, align.block_expert, align.expert_offsets, align.expert_counts,
        aq.shape[0], n, k, aq.stride(0), w.stride(0), w.stride(1), s.stride(0), s.stride(1),
        s.stride(2) if s.shape[2] > 1 else 0, out.stride(0), A_DIV=a_div, GROUP_N=block_n,
        GROUP_K=block_k if block_k < k else 1 << 30, ROWS_SHARE=block_n % bn == 0, EVEN_K=k % group == 0,
        BLOCK_M=align.block_m, BLOCK_N=bn, BLOCK_K=group, GROUP_M=group_m, W_TMA=tma, num_warps=tile["num_warps"],
        num_stages=tile["num_stages"],
    )  # fmt: skip
    return out


def use_tma(w: torch.Tensor, group: int, choice: int | bool | None = None) -> bool:
    """Whether a grouped GEMM reads its expert tiles through a TMA descriptor: ``choice`` (a table's or a
    test's ``TMA1`` / ``TMA2``) where given, else on a GPU (on the H200, Qwen3.6 experts, whole MoE calls:
    1.00-1.05x from 8 to 4096 tokens, 0.96x at 16K, which the Qwen table turns off); always only for contiguous
    experts of whole K tiles."""
    fits = TensorDescriptor is not None and w.is_contiguous() and w.shape[2] % group == 0 and w.shape[2] % 16 == 0
    if choice is not None:
        if choice and not fits:
            raise ValueError(f"fp8 grouped MoE: TMA needs contiguous experts of whole {group}-column tiles, not "
                             f"{tuple(w.shape)}")
        return bool(choice)
    return fits and on_gpu(w.device)


def grouped_block_m(num_pairs: int, gpu: bool, num_experts: int | None = None) -> int:
    """Rows per grouped tile without a table entry. By average rows per expert (``num_experts`` given): 16
    below 32, 32 below 64, else 64 (on the H200 at Qwen3.6's 257 experts, 16 rows ran 1.8-2.2x the 64 of the
    pair-count rule at 128-512 tokens); without it 64 from 1024 pairs, else 16. (128-row tiles with 8 warps,
    tried for experts of 256+ rows, timed 4215.7 us against 4024.0 us for 64 at a 16K-token prefill on the
    H200; ``block_m=128`` still selects them.)"""
    if not gpu:
        return 16
    if num_experts is None:
        return 64 if num_pairs >= 1024 else 16
    avg = num_pairs / num_experts
    return 16 if avg < 32 else 32 if avg < 64 else 64


def grouped_defaults(num_pairs: int, gpu: bool, block_m: int | None = None, num_experts: int | None = None) -> dict:
    """The grouped launch without a table entry (variant "grouped"): ``block_m`` (None: grouped_block_m) rows, 128-wide tiles
    (32 in the interpreter), 8 warps for 128-row tiles (the dense prefill GEMM's config), else 4; 4 stages."""
    bm = grouped_block_m(num_pairs, gpu, num_experts) if block_m is None else block_m
    bn, warps, stages = (128, 8 if bm >= 128 else 4, 4) if gpu else (32, 4, 1)
    return {"variant": "grouped", "BLOCK_M": bm, **{f"{key}{gemm}": value for gemm in (1, 2)
                                                    for key, value in zip(_GROUPED_TILE_KEYS, (bn, warps, stages, 0))}}


def grouped_config_key(num_experts: int, hidden: int, inter: int, top_k: int, num_pairs: int) -> str:
    """Tuning key: the expert shape, slots per token and average rows per expert rounded up to a
    GROUPED_BUCKETS bucket (the last one takes everything above it)."""
    avg = cdiv(num_pairs, num_experts)
    bucket = next((b for b in GROUPED_BUCKETS if avg <= b), GROUPED_BUCKETS[-1])
    return f"e{num_experts}_h{hidden}_i{inter}_k{top_k}_r{bucket}"


def grouped_config(num_experts: int, hidden: int, inter: int, top_k: int, num_pairs: int,
                   device: torch.device) -> dict:
    """Launch parameters of the grouped path: grouped_defaults under the "fp8_moe_grouped" tables."""
    key = grouped_config_key(num_experts, hidden, inter, top_k, num_pairs)
    return tuning.kernel_config(TUNING_PACKAGE, GROUPED_KERNEL, key,
                                grouped_defaults(num_pairs, on_gpu(device), num_experts=num_experts), device)


def grouped_tile(cfg: dict, gemm: int) -> dict:
    """One GEMM's launch keys out of a grouped config, checked (tl.dot and tl.arange need powers of two)."""
    tile = {key: cfg[f"{key}{gemm}"] for key in _GROUPED_TILE_KEYS}
    tile["TMA"] = cfg.get(f"TMA{gemm}")  # optional: None leaves it to use_tma's rule
    if tile["BLOCK_N"] < 16 or tile["BLOCK_N"] & (tile["BLOCK_N"] - 1) or tile["GROUP_M"] < 0:
        raise ValueError(f"fp8 grouped MoE: BLOCK_N{gemm} must be a power of two >= 16 and GROUP_M{gemm} >= 0, "
                         f"not {tile}")
    return tile
