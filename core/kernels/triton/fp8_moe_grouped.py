"""FP8 grouped MoE GEMMs for prefill over expert-sorted rows, the up GEMM with the activation and its quantization in its epilogue, and their launch configs.

Rows are sorted by expert into BLOCK_M blocks (``moe_align``); a GEMM's input is e4m3 rows with a
scale per row and 128-column group (``fp8_gemm.quantize_act``), and the tiles multiply on the fp8
tensor cores with ``acc += dot · a_scale · w_scale`` per K step, loads pipelined through shared memory
(the expert tiles through a TMA descriptor on a GPU: ``use_tma``).

- ``_grouped_gemm``: per-pair rows [P, N] in x's dtype (the down GEMM; the up GEMM where the activation
  is not fused).
- ``grouped_act_gemm`` (the up GEMM with ``FUSE_ACT1``): a program computes the [BLOCK_M, G] tile of gate
  columns n0..n0+G and of up columns I+n0..I+n0+G (G the 128-column quantization group), rounds both to
  x's dtype as h's store would, applies act(gate) · up with ``fp8_gemm``'s exact activation and quantizes
  the tile per row as ``quantize_act`` does: (hq [P, I], hs [I / G, P]) bit-equal to ``_grouped_gemm``
  then ``quantize_act(h, G, activation, gated=True)``, without the bf16 h [P, 2I] written and read back
  (302 MB at a 16K-token Qwen3.6 prefill). Its tile is G gate and G up columns whatever BLOCK_N1 says
  (BLOCK_N1 only sets the scale product order, the unfused launch's under the same config); a pipeline
  stage holds [BLOCK_M, BK] + 2 x [G, BK] e4m3; the weight tiles go through TMA as the unfused launch's.

Rows per tile, each GEMM's tile width, warps, stages, GROUP_M swizzle, TMA and FUSE_ACT1 come from the
"fp8_moe_grouped" tuning entry (keyed by experts, hidden, intermediate, top-k and rows per expert;
``bench/fp8_moe_grouped_sweep.py`` measures it); BLOCK_K is the 128-column scale group.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from armillary.kernels import tuning
from armillary.kernels.fp8 import FP8_MAX
from armillary.kernels.triton.fp8_cast import exact_div, to_e4m3
from armillary.kernels.triton.fp8_gemm import _exact_activation, act_group
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
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _tile_pids(n_tiles, GROUP_M: tl.constexpr):
    """(pid_m, pid_n): grid (blocks, n_tiles), or with GROUP_M > 0 a 1-D grid where GROUP_M consecutive blocks
    (mostly one expert) walk the N tiles together, sharing their a rows in L2."""
    if GROUP_M > 0:
        pid = tl.program_id(0)
        per_group = GROUP_M * n_tiles
        first = (pid // per_group) * GROUP_M
        group_rows = tl.minimum(tl.num_programs(0) // n_tiles - first, GROUP_M)
        return first + (pid % per_group) % group_rows, (pid % per_group) // group_rows
    return tl.program_id(0), tl.program_id(1)


@triton.jit
def _block_pairs(sorted_ptr, offsets_ptr, counts_ptr, e, pid_m, BLOCK_M: tl.constexpr):
    """(pair [BM] int64, row_ok [BM]) of expert-sorted block ``pid_m`` of expert ``e``; padding rows read pair 0."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < tl.load(offsets_ptr + e) + tl.load(counts_ptr + e)
    return tl.load(sorted_ptr + rows, mask=row_ok, other=0).to(tl.int64), row_ok


@triton.jit
def _scaled_add(acc, a, w, a_s, w_s, SCALES_FIRST: tl.constexpr, PER_COLUMN: tl.constexpr):
    """acc + dot(a, w) · a_s[:, None] · w_s (w_s a scalar, or [BN] with PER_COLUMN); SCALES_FIRST: a_s · w_s
    multiplied first."""
    d = tl.dot(a, w)
    if SCALES_FIRST:
        if PER_COLUMN:
            return acc + d * (a_s[:, None] * w_s[None, :])
        return acc + d * (a_s[:, None] * w_s)
    d = d * a_s[:, None]
    if PER_COLUMN:  # expanded after the row scales: the same PTX as one expression written inline
        return acc + d * w_s[None, :]
    return acc + d * w_s


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
    pid_m, pid_n = _tile_pids(tl.cdiv(N, BLOCK_N), GROUP_M)
    e = tl.load(block_expert_ptr + pid_m)
    if e < 0:
        return
    pair, row_ok = _block_pairs(sorted_ptr, offsets_ptr, counts_ptr, e, pid_m, BLOCK_M)
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
        else:
            w_s = tl.load(s_base + (cols // GROUP_N) * stride_sn + (k0 // GROUP_K) * stride_sk)  # [BN]
        acc = _scaled_add(acc, a, w, a_s, w_s, ROWS_SHARE, not ROWS_SHARE)
        a_ptrs += BLOCK_K
        if not W_TMA:
            w_ptrs += BLOCK_K
    dst = out_ptr + pair[:, None] * stride_om + offs_n[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n < N)[None, :])


@triton.jit
def _grouped_act_kernel(
    a_ptr, as_ptr, w_ptr, s_ptr, q_ptr, qs_ptr, sorted_ptr, block_expert_ptr, offsets_ptr, counts_ptr, A_ROWS, P, I,
    K, stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_qm,
    A_DIV: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, ROWS_SHARE: tl.constexpr,
    SCALES_FIRST: tl.constexpr, EVEN_K: tl.constexpr, ACTIVATION: tl.constexpr, H_DTYPE: tl.constexpr,
    FP8_LIMIT: tl.constexpr, BLOCK_M: tl.constexpr, G: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    W_TMA: tl.constexpr,
):  # fmt: skip
    """Grid (max_blocks, I / G), or (max_blocks · I / G,) with GROUP_M > 0: rows of expert-sorted block
    ``pid_m`` (input row pair // A_DIV of a [A_ROWS, K], scales [cdiv(K, BK), A_ROWS]) times the gate rows
    n0..n0+G and up rows I+n0..I+n0+G of w13[e] [2I, K], n0 = pid_n · G; h = act(gate) · up rounded at each
    step to H_DTYPE as h's store and quantize_act's gated pass round it, stored quantized: q[pair, n0:n0+G]
    e4m3 (q [P, I]) and qs[pid_n, pair] = amax / 448 (qs [I / G, P]). ROWS_SHARE: each G-row tile inside one
    weight scale row (a scalar scale per K step); SCALES_FIRST: the scale product order of the unfused launch
    under the same tiles. ``W_TMA``: ``w_ptr`` is a [E · 2I, K] descriptor with [G, BK] blocks."""
    pid_m, pid_n = _tile_pids(I // G, GROUP_M)
    e = tl.load(block_expert_ptr + pid_m)
    if e < 0:
        return
    pair, row_ok = _block_pairs(sorted_ptr, offsets_ptr, counts_ptr, e, pid_m, BLOCK_M)
    src = pair // A_DIV
    n0 = pid_n * G
    gate_cols = n0 + tl.arange(0, G)
    up_cols = gate_cols + I
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + src[:, None] * stride_am + offs_k[None, :]  # [BM, BK]
    s_base = s_ptr + e.to(tl.int64) * stride_se
    if W_TMA:
        gate_row = e * (2 * I) + n0  # the up rows start I descriptor rows further
    else:
        w_e = w_ptr + e.to(tl.int64) * stride_we + offs_k[:, None]
        g_ptrs = w_e + gate_cols[None, :].to(tl.int64) * stride_wn  # [BK, G], K-major
        u_ptrs = w_e + up_cols[None, :].to(tl.int64) * stride_wn
    acc_g = tl.zeros((BLOCK_M, G), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, G), dtype=tl.float32)
    for kt in range(0, tl.cdiv(K, BLOCK_K)):
        k0 = kt * BLOCK_K
        if W_TMA:
            a = tl.load(a_ptrs)
            wg = w_ptr.load([gate_row, k0]).T
            wu = w_ptr.load([gate_row + I, k0]).T
        elif EVEN_K:
            a = tl.load(a_ptrs)
            wg = tl.load(g_ptrs)
            wu = tl.load(u_ptrs)
        else:
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            wg = tl.load(g_ptrs, mask=k_ok[:, None], other=0.0)
            wu = tl.load(u_ptrs, mask=k_ok[:, None], other=0.0)
        a_s = tl.load(as_ptr + kt * A_ROWS + src)  # [BM]
        s_k = s_base + (k0 // GROUP_K) * stride_sk
        if ROWS_SHARE:
            gs = tl.load(s_k + (n0 // GROUP_N) * stride_sn)
            us = tl.load(s_k + ((n0 + I) // GROUP_N) * stride_sn)
        else:  # a scale per column: the tile spans scale rows
            gs = tl.load(s_k + (gate_cols // GROUP_N) * stride_sn)  # [G]
            us = tl.load(s_k + (up_cols // GROUP_N) * stride_sn)
        acc_g = _scaled_add(acc_g, a, wg, a_s, gs, SCALES_FIRST, not ROWS_SHARE)
        acc_u = _scaled_add(acc_u, a, wu, a_s, us, SCALES_FIRST, not ROWS_SHARE)
        a_ptrs += BLOCK_K
        if not W_TMA:
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
    # each value rounded where the unfused path stores it: h in H_DTYPE, act(gate) and the product as act_and_mul
    up = acc_u.to(H_DTYPE).to(tl.float32)
    h = _exact_activation(acc_g.to(H_DTYPE).to(tl.float32), ACTIVATION).to(H_DTYPE)
    h = (h.to(tl.float32) * up).to(H_DTYPE).to(tl.float32)
    amax = tl.max(tl.abs(h), axis=1)  # [BM]: the whole quantization group is this tile's
    scale = tl.maximum(exact_div(amax, tl.full(amax.shape, FP8_LIMIT, tl.float32)), 1e-12)
    q = to_e4m3(exact_div(h, tl.broadcast_to(scale[:, None], h.shape)))
    tl.store(q_ptr + pair[:, None] * stride_qm + gate_cols[None, :], q,
             mask=row_ok[:, None] & (gate_cols < I)[None, :])
    tl.store(qs_ptr + pid_n.to(tl.int64) * P + pair, scale, mask=row_ok)


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


def fuses_act(w13: torch.Tensor, inter: int, block_k: int, dtype: torch.dtype, cfg: dict) -> bool:
    """Whether the up GEMM can take the activation and its quantization (``grouped_act_gemm``): the config's
    FUSE_ACT1 on, a gated w13 [E, 2I, H], I whole quantization groups and h's dtype one Triton names."""
    return bool(cfg.get("FUSE_ACT1")) and w13.shape[1] == 2 * inter and dtype in _TL_DTYPES \
        and inter % act_group(inter, block_k) == 0


def grouped_act_gemm(aq: torch.Tensor, a_s: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, block_n: int,
                     block_k: int, a_div: int, num_pairs: int, align, h_dtype: torch.dtype, activation: int,
                     tile: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The up GEMM with act(gate) · up quantized in its epilogue: (hq [pairs, I] e4m3, hs [I / G, pairs] fp32),
    bit-equal to ``quantize_act(_grouped_gemm(..., h_dtype, tile), G, activation, gated=True)`` (``activation``
    a moe_decode ACT_* code; ``fuses_act`` must hold). ``tile``'s BLOCK_N is the unfused launch's: the fused one
    is G columns of gate and G of up; it only sets the scale product order the unfused launch would use."""
    e, n, k = w13.shape
    inter = n // 2
    g, group = act_group(inter, block_k), act_group(k, block_k)
    hq = torch.empty(num_pairs, inter, dtype=torch.float8_e4m3fn, device=aq.device)
    hs = torch.empty(inter // g, num_pairs, dtype=torch.float32, device=aq.device)
    group_m = tile["GROUP_M"]
    blocks, n_tiles = align.block_expert.shape[0], inter // g
    tma = use_tma(w13, group, tile.get("TMA"))
    w_arg = TensorDescriptor.from_tensor(w13.view(e * n, k), [g, group]) if tma else w13
    _grouped_act_kernel[(blocks * n_tiles,) if group_m > 0 else (blocks, n_tiles)](
        aq, a_s, w_arg, s13, hq, hs, align.sorted_pair_ids, align.block_expert, align.expert_offsets,
        align.expert_counts, aq.shape[0], num_pairs, inter, k, aq.stride(0), w13.stride(0), w13.stride(1),
        s13.stride(0), s13.stride(1), s13.stride(2) if s13.shape[2] > 1 else 0, hq.stride(0), A_DIV=a_div,
        GROUP_N=block_n, GROUP_K=block_k if block_k < k else 1 << 30, ROWS_SHARE=block_n % g == 0,
        SCALES_FIRST=block_n % tile["BLOCK_N"] == 0, EVEN_K=k % group == 0, ACTIVATION=activation,
        H_DTYPE=_TL_DTYPES[h_dtype], FP8_LIMIT=FP8_MAX, BLOCK_M=align.block_m, G=g, BLOCK_K=group, GROUP_M=group_m,
        W_TMA=tma, num_warps=tile["num_warps"], num_stages=tile["num_stages"],
    )  # fmt: skip
    return hq, hs


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
    (32 in the interpreter), 8 warps for 128-row tiles (the dense prefill GEMM's config), else 4; 4 stages;
    FUSE_ACT1 0: h in x's dtype, then the quantization launch (1: the up GEMM quantizes act(gate) · up in its
    epilogue where ``fuses_act`` allows; bit-equal, but on the H200 at Qwen3.6's experts, Qwen table tiles,
    whole MoE calls, 196.8 -> 199.5 us at 64 tokens, 508.6 -> 536.9 at 2K, 2603.0 -> 2982.3 at 16K)."""
    bm = grouped_block_m(num_pairs, gpu, num_experts) if block_m is None else block_m
    bn, warps, stages = (128, 8 if bm >= 128 else 4, 4) if gpu else (32, 4, 1)
    return {"variant": "grouped", "BLOCK_M": bm, **{f"{key}{gemm}": value for gemm in (1, 2)
                                                    for key, value in zip(_GROUPED_TILE_KEYS, (bn, warps, stages, 0))},
            "FUSE_ACT1": 0}


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
