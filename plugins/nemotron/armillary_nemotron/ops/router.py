"""The MoE router's fp32 logits ``x @ W^T`` in one Triton launch (x in the model dtype, W [E, H] float32), no fp32 copy of x.

``F.linear(x.float(), W)`` costs a cast launch (at 16K tokens a 176 MB fp32 copy of x) and an fp32
cuBLAS GEMM (at decode a dot and a reduce kernel). Two kernels, both fp32-accurate:

* ``_router_fma_kernel`` (decode-sized rows): CUDA-core fp32 multiply-adds, x widened in registers;
  one row keeps per-lane partial sums over the K loop and reduces once at the end.
* ``_router_dot_kernel`` (bf16 x, many rows): tensor cores. Each fp32 weight tile is split in
  registers into three bf16 terms W = hi + mid + lo (8 significand bits each: 24, all of fp32's),
  every bf16 x bf16 product is exact in the fp32 accumulator, and the three partial sums (one
  accumulator each, smallest added first) give the fp32 product to fp32 rounding.

Other dtypes at many rows, and row classes the tuning table marks ``"use": false``, take
``F.linear(x.float(), W)``. Grids follow the shapes and
nothing syncs with the host (CUDA-graph capturable). Reference: ``router_logits_ref``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from armillary.kernels.triton.host import cdiv, next_power_of_2
from armillary.kernels.tuning import kernel_config

TUNING_PACKAGE = "armillary_nemotron"
KERNEL = "router_gemm"
# use: False sends the row class to F.linear(x.float(), W) (where a GPU's sweep finds cuBLAS faster);
# fma_max_rows: the most rows the FMA kernel takes; BLOCK_T 0: the rows rounded up to a power of two
FMA_DEFAULTS = {"use": True, "fma_max_rows": 8, "BLOCK_T": 0, "BLOCK_E": 2, "BLOCK_K": 1024, "num_warps": 4,
                "num_stages": 1}
DOT_MID = {**FMA_DEFAULTS, "BLOCK_T": 16, "BLOCK_E": 16, "BLOCK_K": 128, "num_warps": 4, "num_stages": 2}
DOT_WIDE = {**FMA_DEFAULTS, "BLOCK_T": 64, "BLOCK_E": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}


def router_logits_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The naive fp32 product: x [T, H] (any float dtype), weight [E, H] -> [T, E] float32."""
    return x.float() @ weight.float().t()


@triton.jit
def _router_fma_kernel(x_ptr, w_ptr, out_ptr, T, E, K, stride_x, stride_w, stride_o, BLOCK_T: tl.constexpr,
                       BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """Grid (E tiles, T tiles): out [BT, BE] of W rows ``BLOCK_E`` at a time, the whole of K."""
    offs_e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_k = tl.arange(0, BLOCK_K)
    e_ok = offs_e < E
    t_ok = offs_t < T
    w_rows = w_ptr + offs_e[:, None].to(tl.int64) * stride_w  # [BE, 1]
    x_rows = x_ptr + offs_t[:, None].to(tl.int64) * stride_x  # [BT, 1]
    if BLOCK_T == 1:
        wide = tl.zeros([BLOCK_E, BLOCK_K], dtype=tl.float32)  # per-lane partial sums, reduced once
        for k0 in range(0, K, BLOCK_K):
            k_ok = k0 + offs_k < K
            w = tl.load(w_rows + k0 + offs_k[None, :], mask=e_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptr + offs_t.to(tl.int64) * stride_x + k0 + offs_k, mask=t_ok & k_ok, other=0.0)
            wide += w.to(tl.float32) * x.to(tl.float32)[None, :]
        acc = tl.sum(wide, axis=1)[:, None]  # [BE, 1]
    else:
        acc = tl.zeros([BLOCK_E, BLOCK_T], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = k0 + offs_k < K
            w = tl.load(w_rows + k0 + offs_k[None, :], mask=e_ok[:, None] & k_ok[None, :], other=0.0)  # [BE, BK]
            x = tl.load(x_rows + k0 + offs_k[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0)  # [BT, BK]
            acc += tl.sum(w.to(tl.float32)[:, None, :] * x.to(tl.float32)[None, :, :], axis=2)
    out = out_ptr + offs_t[None, :].to(tl.int64) * stride_o + offs_e[:, None]  # [BE, BT]
    tl.store(out, acc, mask=e_ok[:, None] & t_ok[None, :])


@triton.jit
def _router_dot_kernel(x_ptr, w_ptr, out_ptr, T, E, K, stride_x, stride_w, stride_o, BLOCK_T: tl.constexpr,
                       BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """Grid (E tiles, T tiles): out [BT, BE] as the sum of x·loᵀ, x·midᵀ and x·hiᵀ, the terms in x's dtype
    (bf16 in use; the CPU tests run fp16, since the interpreter's bf16 tl.dot is not exact)."""
    offs_e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_k = tl.arange(0, BLOCK_K)
    e_ok = offs_e < E
    t_ok = offs_t < T
    w_rows = w_ptr + offs_e[:, None].to(tl.int64) * stride_w
    x_rows = x_ptr + offs_t[:, None].to(tl.int64) * stride_x
    acc_hi = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    acc_mid = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    acc_lo = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + offs_k < K
        w = tl.load(w_rows + k0 + offs_k[None, :], mask=e_ok[:, None] & k_ok[None, :], other=0.0)  # [BE, BK] fp32
        x = tl.load(x_rows + k0 + offs_k[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0)  # [BT, BK] bf16
        hi = w.to(x.dtype)
        rest = w - hi.to(tl.float32)  # exact: w and hi share their leading bits
        mid = rest.to(x.dtype)
        lo = (rest - mid.to(tl.float32)).to(x.dtype)
        acc_hi = tl.dot(x, tl.trans(hi), acc_hi)
        acc_mid = tl.dot(x, tl.trans(mid), acc_mid)
        acc_lo = tl.dot(x, tl.trans(lo), acc_lo)
    acc = acc_lo + acc_mid + acc_hi  # smallest first
    out = out_ptr + offs_t[:, None].to(tl.int64) * stride_o + offs_e[None, :]
    tl.store(out, acc, mask=t_ok[:, None] & e_ok[None, :])


def router_config(rows: int, device: torch.device | None = None) -> dict:
    """Launch config for ``rows`` tokens: key ``t{rows rounded up to 2^i}`` (``t1024`` and up share one)."""
    rows_p2 = min(next_power_of_2(max(rows, 1)), 1024)
    defaults = FMA_DEFAULTS if rows_p2 <= 8 else DOT_MID if rows_p2 <= 256 else DOT_WIDE
    return kernel_config(TUNING_PACKAGE, KERNEL, f"t{rows_p2}", defaults, device)


def router_logits(x: torch.Tensor, weight: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """x [T, H] (unit column stride), weight [E, H] float32 (unit column stride) -> [T, E] float32."""
    rows, k = x.shape
    if weight.dtype != torch.float32 or weight.shape[1] != k or weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"router_logits: x {tuple(x.shape)} / weight {tuple(weight.shape)} {weight.dtype} "
                         "do not fit (fp32 weight, unit column strides)")
    cfg = {**router_config(rows, x.device), **(config or {})}
    fma = rows <= cfg["fma_max_rows"]
    if not cfg["use"] or (not fma and x.dtype != torch.bfloat16):
        return F.linear(x.float(), weight)  # the table's choice; the three-term split is exact for bf16 x only
    return launch(x, weight, cfg, fma)


def launch(x: torch.Tensor, weight: torch.Tensor, cfg: dict, fma: bool) -> torch.Tensor:
    """One launch of the FMA or the three-term kernel (``router_logits`` picks; tests call it directly)."""
    rows, k = x.shape
    experts = weight.shape[0]
    out = torch.empty(rows, experts, dtype=torch.float32, device=x.device)
    if rows == 0:
        return out
    block_t, block_e = cfg["BLOCK_T"] or next_power_of_2(rows), cfg["BLOCK_E"]
    block_k = min(cfg["BLOCK_K"], max(16, next_power_of_2(k)))
    if not fma:  # tl.dot wants every dim >= 16
        block_t, block_e, block_k = max(block_t, 16), max(block_e, 16), max(block_k, 16)
    grid = (cdiv(experts, block_e), cdiv(rows, block_t))
    kernel = _router_fma_kernel if fma else _router_dot_kernel
    kernel[grid](x, weight, out, rows, experts, k, x.stride(0), weight.stride(0), out.stride(0), BLOCK_T=block_t,
                 BLOCK_E=block_e, BLOCK_K=block_k, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out
