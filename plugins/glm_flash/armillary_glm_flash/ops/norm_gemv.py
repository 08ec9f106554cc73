"""Few-row GEMV with the RMSNorm of its input fused: ``y = (rms_norm(x) · w) @ W^T`` in one launch (MLA's
``q_a_layernorm`` folded into ``q_b_proj`` on decode steps: no norm launch, no [T, q_lora_rank] round trip).

y[m, n] = rstd[m] · Σ_k W[n, k] · (x[m, k] · w[k]), rstd[m] = 1 / sqrt(mean_k x[m, k]² + eps), all in
float32 in one pass over K: the loop that streams W also sums x², so rstd scales the finished dot
products (the weights are not touched at load time; prefill keeps the norm + GEMM pair). The one
rounding the unfused pair makes that this skips is the normed row's to the model dtype: in float32 the
two agree to the last bits, in bf16 this is the closer to the float32 reference. ``dot``: x · w is
rounded to x's dtype for ``tl.dot`` (rows padded to 16). Programs tile N and take the whole K (q_lora_rank
768: no split), so the grid follows the shapes: CUDA-graph safe, PDL-aware. Opt-in per shape: the plugin
table's ``"norm_gemv"`` entry ``"n{N}_k{K}_m{rows rounded up to 2^i}": {"use": true}`` (always under the
forced "triton" backend, as the CPU tests run). The reference is ``norm_gemv_ref``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from armillary.kernels import ops, tuning
from armillary.kernels.triton.host import cdiv, next_power_of_2
from armillary.kernels.triton.pdl import launch_options, pdl_launch_dependents, pdl_wait, prefetch_rows_l2

PACKAGE = "armillary_glm_flash"
KERNEL = "norm_gemv"
# path: fma (CUDA-core multiply-adds, rows in registers) | dot (tl.dot, rows and BLOCK_N padded to 16)
DEFAULTS = {"use": False, "max_rows": 8, "path": "fma", "BLOCK_N": 8, "BLOCK_K": 256, "num_warps": 4,
            "num_stages": 1}


@triton.jit
def _norm_gemv_kernel(x_ptr, nw_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om, eps,
                      ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr,
                      DOT_PRECISION: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr):
    """Grid (cdiv(N, BLOCK_N),): out[:, tile] for every row (ROWS: the rows rounded up, 16+ with USE_DOT)."""
    pdl_launch_dependents(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    if PREFETCH:  # W is not the previous kernel's: ask L2 for this tile's rows before waiting
        prefetch_rows_l2(w_ptr, tl.minimum(offs_n, N - 1), stride_wn, 0, K, BLOCK_K)
    pdl_wait(PDL)
    offs_k = tl.arange(0, BLOCK_K)
    rows = tl.arange(0, ROWS)
    m_ok = rows < M
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]  # [BN, BK]
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + offs_k[None, :]  # [ROWS, BK]
    squares = tl.zeros([ROWS, BLOCK_K], dtype=tl.float32)
    wide = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc = tl.zeros([BLOCK_N, ROWS], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            w_mask = n_ok[:, None]
            x_mask = m_ok[:, None]
            nw = tl.load(nw_ptr + k0 + offs_k)
        else:
            k_ok = offs_k < K - k0
            w_mask = n_ok[:, None] & k_ok[None, :]
            x_mask = m_ok[:, None] & k_ok[None, :]
            nw = tl.load(nw_ptr + k0 + offs_k, mask=k_ok, other=0.0)
        w = tl.load(w_ptrs + k0, mask=w_mask, other=0.0)
        x = tl.load(x_ptrs + k0, mask=x_mask, other=0.0).to(tl.float32)
        squares += x * x
        xw = x * nw.to(tl.float32)[None, :]  # [ROWS, BK]: the norm's weight, before rstd is known
        if USE_DOT:
            acc = tl.dot(w, tl.trans(xw.to(w.dtype)), acc, input_precision=DOT_PRECISION)  # [BN, ROWS]
        elif ROWS == 1:
            wide += w.to(tl.float32) * xw  # one reduction after the loop
        else:
            acc += tl.sum(w.to(tl.float32)[:, None, :] * xw[None, :, :], axis=2)  # [BN, ROWS]
    if not USE_DOT and ROWS == 1:
        acc = tl.sum(wide, axis=1)[:, None]
    rstd = tl.rsqrt(tl.sum(squares, axis=1) / K + eps)  # [ROWS]
    y = acc * rstd[None, :]
    out_ptrs = out_ptr + rows[None, :].to(tl.int64) * stride_om + offs_n[:, None]
    tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


def norm_gemv_config(rows: int, n: int, k: int, device: torch.device | None = None) -> dict:
    """The launch config for [rows, k] x [n, k] from the plugin's tables over ``DEFAULTS``."""
    key = f"n{n}_k{k}_m{next_power_of_2(max(rows, 1))}"
    return tuning.kernel_config(PACKAGE, KERNEL, key, DEFAULTS, device)


def serves(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the fused launch takes this call: Triton serves x, decode-sized rows, one dtype, unit strides,
    and the table marks the shape ``"use": true`` (or the "triton" backend forces Triton)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[0] == 0 or not ops.use_triton(x):
        return False
    if x.shape[1] != weight.shape[1] or norm_weight.shape != (x.shape[1],) or weight.dtype != x.dtype:
        return False
    if x.stride(1) != 1 or weight.stride(1) != 1 or not norm_weight.is_contiguous():
        return False
    cfg = norm_gemv_config(x.shape[0], weight.shape[0], weight.shape[1], x.device)
    return x.shape[0] <= cfg["max_rows"] and (cfg["use"] or ops.get_backend() == "triton")


def norm_gemv_ref(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor) -> torch.Tensor:
    """The float32 reference: rms_norm(x) · w (no rounding between) @ W^T -> [M, N] float32."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    return normed @ weight.float().t()


def norm_gemv(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
              config: dict | None = None) -> torch.Tensor:
    """x [M, K] (unit last stride, any row stride), norm_weight [K], weight [N, K] (x's dtype) -> [M, N] in x's dtype."""
    rows, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or norm_weight.shape != (k,) or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"norm_gemv: x {tuple(x.shape)} / norm {tuple(norm_weight.shape)} / weight "
                         f"{tuple(weight.shape)} do not fit (unit last strides)")
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    cfg = {**norm_gemv_config(rows, n, k, x.device), **(config or {})}
    use_dot = cfg["path"] == "dot"
    row_block = max(16, next_power_of_2(rows)) if use_dot else next_power_of_2(rows)
    block_n = max(16, cfg["BLOCK_N"]) if use_dot else cfg["BLOCK_N"]
    block_k = cfg["BLOCK_K"] if row_block == 1 or use_dot else min(cfg["BLOCK_K"], 64)  # [BN, rows, BK] in registers
    block_k = min(block_k, max(16, next_power_of_2(k)))
    _norm_gemv_kernel[(cdiv(n, block_n),)](
        x, norm_weight, weight, out, rows, n, k, x.stride(0), weight.stride(0), out.stride(0), float(eps),
        ROWS=row_block, BLOCK_N=block_n, BLOCK_K=block_k, USE_DOT=use_dot,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", EVEN_K=k % block_k == 0,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch_options(x.device, prefetch="weights"))
    return out
