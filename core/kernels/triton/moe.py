"""Fused MoE experts on Triton: grouped GEMMs over expert-sorted blocks, or a decode path for few pairs.

``fused_moe`` has the reference's contract (armillary.kernels.moe.fused_moe). Prefill: align the
(token, slot) pairs by expert (moe_align), GEMM 1 with the activation-and-multiply in its
epilogue into a row-sorted intermediate, GEMM 2 with the routing weight multiplied in, scattered
back to pair order, then the top-k rows of each token summed in float32 (no atomics, so the
result does not depend on scheduling). Decode (pairs <= the table's ``max_pairs``): moe_decode.
A few tokens (T <= the "fused_moe_gemv" table's ``max_tokens``): moe_gemv, row-streaming GEMVs
with the top-k sum fused into the down kernel. Every launch has a grid fixed by shapes, so every
path can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from armillary.kernels.triton.host import cdiv, next_power_of_2
from armillary.kernels.triton.moe_align import moe_align
from armillary.kernels.triton.moe_decode import (
    ACT_GELU_TANH,
    ACT_RELU2,
    ACT_SILU,
    _activation,
    _expert_tile_dot,
    moe_decode_down_kernel,
    moe_decode_up_kernel,
)
from armillary.kernels.triton.moe_gemv import LOOP_STATIC, moe_gemv
from armillary.kernels.tuning import kernel_config

TUNING_PACKAGE = "armillary.kernels"
_ACTIVATIONS = {"silu": ACT_SILU, "swish": ACT_SILU, "relu2": ACT_RELU2, "gelu_pytorch_tanh": ACT_GELU_TANH,
                "gelu_tanh": ACT_GELU_TANH}

# defaults = the H200 measurements for ~64 rows per expert and for decode (tuning/sm_90.json)
GROUPED_DEFAULTS = {
    "BLOCK_M": 64, "GROUP_M": 8,
    "BLOCK_N1": 128, "BLOCK_K1": 64, "num_warps1": 4, "num_stages1": 4,
    "BLOCK_N2": 128, "BLOCK_K2": 64, "num_warps2": 4, "num_stages2": 4,
}  # fmt: skip
DECODE_DEFAULTS = {
    "max_pairs": 16,
    "BLOCK_N1": 64, "BLOCK_K1": 128, "num_warps1": 4, "num_stages1": 4,
    "BLOCK_N2": 128, "BLOCK_K2": 64, "num_warps2": 4, "num_stages2": 4,
}  # fmt: skip
# max_tokens 0: auto never picks the GEMV path where a target's table has no entry
GEMV_DEFAULTS = {
    "max_tokens": 0, "pdl": False,
    "BLOCK_N1": 2, "BLOCK_K1": 2048, "LOOP1": LOOP_STATIC, "num_warps1": 4, "num_stages1": 1,
    "BLOCK_N2": 2, "BLOCK_K2": 512, "PAIR_BLOCK": 4, "LOOP2": LOOP_STATIC, "num_warps2": 4, "num_stages2": 1,
}  # fmt: skip


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    pair_weights_ptr,
    sorted_ptr,
    block_expert_ptr,
    offsets_ptr,
    counts_ptr,
    N,
    K,
    up_offset,
    num_blocks,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    TOP_K: tl.constexpr,
    GATHER_TOKENS: tl.constexpr,
    GATED: tl.constexpr,
    ACTIVATION: tl.constexpr,
    ROUTED_WEIGHT: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of one expert block.

    GEMM 1 (GATHER_TOKENS, GATED/ACTIVATION): a rows are x[pair // k], output rows are the sorted
    rows. GEMM 2 (ROUTED_WEIGHT): a rows are the sorted intermediate rows, output rows are pairs.
    """
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    # GROUP_M consecutive blocks (mostly one expert) walk the N tiles together: weight tiles hit in L2
    per_group = GROUP_M * n_tiles
    first_block = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_blocks - first_block, GROUP_M)
    block = first_block + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    expert = tl.load(block_expert_ptr + block)
    if expert >= 0:
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_end = tl.load(offsets_ptr + expert) + tl.load(counts_ptr + expert)
        row_ok = rows < row_end
        pairs = tl.load(sorted_ptr + rows, mask=row_ok, other=0)
        if GATHER_TOKENS:
            a_rows = pairs // TOP_K
        else:
            a_rows = rows
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        safe_n = offs_n % N  # clamped columns keep weight loads unmasked; they are not stored
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + a_rows.to(tl.int64)[:, None] * stride_am + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
        w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + safe_n[None, :] * stride_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc, acc_up = _expert_tile_dot(a_ptrs, w_ptrs, up_offset * stride_wn, K, acc, acc_up, BLOCK_K, EVEN_K, GATED,
                                       DOT_PRECISION)
        if ROUTED_WEIGHT:
            acc = acc * tl.load(pair_weights_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)[:, None]
            out_rows = pairs
            store_ok = row_ok[:, None] & (offs_n[None, :] < N)
        else:
            acc = _activation(acc, ACTIVATION)
            if GATED:
                acc = acc * acc_up
            out_rows = rows
            # padding rows too (finite: computed from token 0), so GEMM 2 never reads uninitialised rows
            store_ok = (rows >= 0)[:, None] & (offs_n[None, :] < N)
        out_ptrs = out_ptr + out_rows.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=store_ok)


@triton.jit
def _sum_topk_kernel(pairs_ptr, weights_ptr, out_ptr, N, TOP_K: tl.constexpr, WEIGHTED: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    """out[t] = sum_j (weights[t, j] ·) pairs[t * k + j] in float32. pairs: [T * k, N], weights: [T, k] -> out: [T, N]."""
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = offs < N
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        row = tl.load(pairs_ptr + (token * TOP_K + j) * N + offs, mask=ok, other=0.0).to(tl.float32)
        if WEIGHTED:
            row = row * tl.load(weights_ptr + token * TOP_K + j).to(tl.float32)
        total += row
    tl.store(out_ptr + token * N + offs, total.to(out_ptr.dtype.element_ty), mask=ok)


def sum_topk(pairs: torch.Tensor, top_k: int, out: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Each token's k pair rows summed in float32 into ``out`` (its dtype), each times its routing weight where
    ``weights`` is given: one pass over the pairs, no fp32 copy of them. pairs: [T * k, N] contiguous,
    weights: [T, k], out: [T, N] contiguous. Returns out."""
    num_tokens, n = out.shape
    if num_tokens == 0:
        return out
    block = min(1024, next_power_of_2(n))
    w = pairs if weights is None else weights.contiguous()  # unread when unweighted
    _sum_topk_kernel[(num_tokens, cdiv(n, block))](pairs, w, out, n, TOP_K=top_k, WEIGHTED=weights is not None,
                                                          BLOCK_N=block)
    return out


GROUPED_BUCKETS = (8, 32, 128, 512)
_K_TILES = ("BLOCK_K1", "BLOCK_K2")


def fit_element_size(cfg: dict, element_size: int) -> dict:
    """The tables hold configs for 2-byte (bf16 / fp16) operands; wider ones get K tiles shallower by
    the same factor, so every pipeline stage keeps its bytes (fp32 at the bf16 depth needs 245760
    bytes of shared memory in the gated GEMM 1, over sm_90's 232448)."""
    if element_size <= 2:
        return cfg
    shrink = element_size // 2
    return {**cfg, **{k: max(16, cfg[k] // shrink) for k in _K_TILES}}


def grouped_config_key(num_pairs: int, num_experts: int) -> str:
    """Tuning key: average rows per expert rounded up to a bucket of GROUPED_BUCKETS (``"r128"``)."""
    avg = cdiv(num_pairs, num_experts)
    return f"r{next((b for b in GROUPED_BUCKETS if avg <= b), GROUPED_BUCKETS[-1])}"


def gemv_config_key(num_tokens: int) -> str:
    """Tuning key of the GEMV path: tokens rounded up to a power of two (``"t4"`` for 3)."""
    return f"t{next_power_of_2(num_tokens)}"


def gemv_config(num_tokens: int, device: torch.device | None = None) -> dict:
    """The GEMV path's table config for ``num_tokens`` (its ``max_tokens`` decides whether auto takes it)."""
    return kernel_config(TUNING_PACKAGE, "fused_moe_gemv", gemv_config_key(num_tokens), GEMV_DEFAULTS, device)


def decode_config(num_pairs: int, device: torch.device | None = None) -> dict:
    pairs_pad = max(16, next_power_of_2(num_pairs))
    return kernel_config(TUNING_PACKAGE, "fused_moe_decode", f"p{pairs_pad}", DECODE_DEFAULTS, device)


def grouped_config(num_pairs: int, num_experts: int, device: torch.device | None = None) -> dict:
    key = grouped_config_key(num_pairs, num_experts)
    return kernel_config(TUNING_PACKAGE, "fused_moe", key, GROUPED_DEFAULTS, device)


def _check_shapes(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor) -> bool:
    """Validate the operands; returns whether the expert is gated (w13 holds [gate | up])."""
    inter = w2.shape[2]
    if w13.shape[1] == 2 * inter:
        gated = True
    elif w13.shape[1] == inter:
        gated = False
    else:
        raise ValueError(f"fused_moe: w13 {tuple(w13.shape)} fits neither [E, 2I, H] nor [E, I, H] for w2 {tuple(w2.shape)}")
    if w13.shape[0] != w2.shape[0] or w13.shape[2] != x.shape[1] or w2.shape[1] != x.shape[1]:
        raise ValueError(f"fused_moe: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} disagree")
    if w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("fused_moe: expert weights must be contiguous in their last dim")
    if topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"fused_moe: topk_ids {tuple(topk_ids.shape)} does not match x {tuple(x.shape)}")
    return gated


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    path: str = "auto",
    config: dict | None = None,
) -> torch.Tensor:
    """Sum over each token's chosen experts of ``weight · expert(x)``; the reference's contract.

    x: [T, H] bf16 / fp16 / fp32; w13: [E, 2I, H] rows [gate | up] (``act(gate) · up``) or
    [E, I, H] (``act(up)``, relu²); w2: [E, H, I]; topk_weights: [T, k] (float32 preferred);
    topk_ids: [T, k] int32 / int64, distinct within a row (as top-k routing gives; the decode path
    relies on it). Returns [T, H] in x's dtype. ``activation``: "silu" | "relu2" | "gelu_pytorch_tanh".
    ``path``: "auto" (GEMV kernels when T <= the "fused_moe_gemv" table's max_tokens, else decode
    kernels when T·k <= the "fused_moe_decode" table's max_pairs, else grouped), "gemv", "decode", "grouped".
    ``config`` overrides keys of the tuning-table entry fitted to the element size (benchmarks, autotuning).
    """
    gated = _check_shapes(x, w13, w2, topk_ids)
    element_size = max(x.element_size(), w13.element_size())
    if activation not in _ACTIVATIONS:
        raise ValueError(f"fused_moe: activation {activation!r} not in {sorted(_ACTIVATIONS)}")
    act = _ACTIVATIONS[activation]
    num_tokens, hidden = x.shape
    num_experts, inter = w2.shape[0], w2.shape[2]
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    ids = topk_ids.contiguous()
    pair_weights = topk_weights.contiguous()
    if path in ("auto", "gemv"):
        gemv = gemv_config(num_tokens, x.device)
        if path == "gemv" or num_tokens <= gemv["max_tokens"]:
            cfg = {**fit_element_size(gemv, element_size), **(config or {})}
            return moe_gemv(x, w13, w2, pair_weights, ids, out, gated, act, cfg)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    pairs_out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)  # [T * k, H]

    pairs_pad = max(16, next_power_of_2(num_pairs))
    decode = decode_config(num_pairs, x.device)
    if path == "decode" or (path == "auto" and num_pairs <= decode["max_pairs"]):
        cfg = {**fit_element_size(decode, element_size), **(config or {})}
        rows = max(16, next_power_of_2(min(num_tokens, num_pairs)))  # most pairs one expert serves
        h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)  # [T * k, I]
        moe_decode_up_kernel[(num_pairs, cdiv(inter, cfg["BLOCK_N1"]))](
            x, w13, ids, h, num_pairs, inter, hidden, inter, x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
            TOP_K=top_k, GATED=gated, ACTIVATION=act, EVEN_K=hidden % cfg["BLOCK_K1"] == 0, DOT_PRECISION=precision,
            PAIRS=pairs_pad, ROWS=rows, BLOCK_N=cfg["BLOCK_N1"], BLOCK_K=cfg["BLOCK_K1"],
            num_warps=cfg["num_warps1"], num_stages=cfg["num_stages1"],
        )  # fmt: skip
        moe_decode_down_kernel[(num_pairs, cdiv(hidden, cfg["BLOCK_N2"]))](
            h, w2, ids, pair_weights, pairs_out, num_pairs, hidden, inter, h.stride(0), w2.stride(0), w2.stride(1),
            pairs_out.stride(0), EVEN_K=inter % cfg["BLOCK_K2"] == 0, DOT_PRECISION=precision,
            PAIRS=pairs_pad, ROWS=rows, BLOCK_N=cfg["BLOCK_N2"], BLOCK_K=cfg["BLOCK_K2"],
            num_warps=cfg["num_warps2"], num_stages=cfg["num_stages2"],
        )  # fmt: skip
    elif path in ("auto", "grouped"):
        table = grouped_config(num_pairs, num_experts, x.device)
        cfg = {**fit_element_size(table, element_size), **(config or {})}
        align = moe_align(ids, num_experts, cfg["BLOCK_M"])
        h = torch.empty(align.max_blocks * align.block_m, inter, dtype=x.dtype, device=x.device)  # sorted rows
        common = (align.sorted_pair_ids, align.block_expert, align.expert_offsets, align.expert_counts)
        n1, n2 = cfg["BLOCK_N1"], cfg["BLOCK_N2"]
        _grouped_gemm_kernel[(align.max_blocks * cdiv(inter, n1),)](
            x, w13, h, pair_weights, *common, inter, hidden, inter, align.max_blocks,
            x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
            TOP_K=top_k, GATHER_TOKENS=True, GATED=gated, ACTIVATION=act, ROUTED_WEIGHT=False,
            EVEN_K=hidden % cfg["BLOCK_K1"] == 0, DOT_PRECISION=precision, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=n1,
            BLOCK_K=cfg["BLOCK_K1"], GROUP_M=cfg["GROUP_M"], num_warps=cfg["num_warps1"], num_stages=cfg["num_stages1"],
        )  # fmt: skip
        _grouped_gemm_kernel[(align.max_blocks * cdiv(hidden, n2),)](
            h, w2, pairs_out, pair_weights, *common, hidden, inter, 0, align.max_blocks,
            h.stride(0), w2.stride(0), w2.stride(1), pairs_out.stride(0),
            TOP_K=top_k, GATHER_TOKENS=False, GATED=False, ACTIVATION=act, ROUTED_WEIGHT=True,
            EVEN_K=inter % cfg["BLOCK_K2"] == 0, DOT_PRECISION=precision, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=n2,
            BLOCK_K=cfg["BLOCK_K2"], GROUP_M=cfg["GROUP_M"], num_warps=cfg["num_warps2"], num_stages=cfg["num_stages2"],
        )  # fmt: skip
    else:
        raise ValueError(f"fused_moe: path {path!r} not in ('auto', 'gemv', 'decode', 'grouped')")
    return sum_topk(pairs_out, top_k, out)
