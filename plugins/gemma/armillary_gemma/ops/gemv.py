"""Few-row GEMV ``y = f(x) @ W^T`` with a Gemma neighbour fused: GeGLU on the input or the logit soft-cap on the output.

* ``geglu``: the dense MLP's down projection reads the gate/up projection's ``[gate | up]`` rows and
  applies ``gelu_tanh(gate) · up`` (rounded to the model dtype, as the GeGLU kernel stores it) while
  it streams W: no GeGLU launch and no ``[T, I]`` round trip.
* ``softcap``: the tied head writes ``cap · tanh(y / cap)`` in float32, y rounded to the model dtype
  first (as the unfused head's output is): no pass over the ``[T, 262K]`` logits after it.

W: [N, K] (nn.Linear's, K contiguous); programs tile N (BLOCK_N rows of W each) and loop over K;
one row keeps per-lane products and reduces once at the end. Opt-in per shape: the plugin table's
``"gemma_gemv"`` entry ``"<kind>_n{N}_k{K}_m{rows rounded up to 2^i}": {"use": true}`` once
bench/gemma_gpu_checks.py has timed it faster than the unfused pair (core's skinny GEMM or cuBLAS,
then the GeGLU / soft-cap launch); always under the forced "triton" backend (the CPU tests).
The reference is ``naive.gemma_gemv_ref``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from armillary.kernels import ops, tuning
from armillary.kernels.triton.host import cdiv, next_power_of_2
from armillary.kernels.triton.pdl import launch_options, pdl_prologue

KERNEL = "gemma_gemv"
KINDS = ("geglu", "softcap")
# the H200 skinny-GEMM sweep's pick for most Gemma 4 one-row shapes (BLOCK_N 8, BLOCK_K 512, 2 warps);
# BLOCK_K 0: 512 for one row, 64 for several (the [BN, rows, BK] product stays in registers)
DEFAULTS = {"use": False, "max_rows": 8, "BLOCK_N": 8, "BLOCK_K": 0, "num_warps": 2, "num_stages": 1}


@triton.jit
def _gemma_gemv_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om, cap,
                       GEGLU: tl.constexpr, SOFTCAP: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr):
    """Grid (cdiv(N, BLOCK_N),): out[:, tile] for every row; GEGLU: x rows are [gate (K) | up (K)]."""
    pdl_prologue(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    rows = tl.arange(0, ROWS)
    m_ok = rows < M
    dt = x_ptr.dtype.element_ty
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]  # [BN, BK]
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + offs_k[None, :]  # [ROWS, BK]
    wide = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc = tl.zeros([BLOCK_N, ROWS], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            w_mask = n_ok[:, None]
            x_mask = m_ok[:, None]
        else:
            k_ok = offs_k < K - k0
            w_mask = n_ok[:, None] & k_ok[None, :]
            x_mask = m_ok[:, None] & k_ok[None, :]
        w = tl.load(w_ptrs + k0, mask=w_mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptrs + k0, mask=x_mask, other=0.0).to(tl.float32)
        if GEGLU:
            up = tl.load(x_ptrs + K + k0, mask=x_mask, other=0.0).to(tl.float32)
            inner = 1.5957691216057308 * (x + 0.044715 * x * x * x)  # 2·sqrt(2/pi), as ops.geglu
            x = (x * tl.sigmoid(inner) * up).to(dt).to(tl.float32)
        if ROWS == 1:
            wide += w * x  # [BN, BK] · [1, BK]: one reduction after the loop
        else:
            acc += tl.sum(w[:, None, :] * x[None, :, :], axis=2)  # [BN, ROWS]
    if ROWS == 1:
        acc = tl.sum(wide, axis=1)[:, None]
    y = acc.to(dt).to(tl.float32)  # the projection's output in the model dtype
    if SOFTCAP:
        y = (2.0 * tl.sigmoid(2.0 * (y / cap)) - 1.0) * cap
    out_ptrs = out_ptr + rows[None, :].to(tl.int64) * stride_om + offs_n[:, None]
    tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


def config(kind: str, rows: int, n: int, k: int, device: torch.device | None = None) -> dict:
    """The launch config of ``kind`` for [rows, k] x [n, k] from the plugin's tables over ``DEFAULTS``."""
    key = f"{kind}_n{n}_k{k}_m{next_power_of_2(max(rows, 1))}"
    return tuning.kernel_config("armillary_gemma", KERNEL, key, DEFAULTS, device)


def serves(kind: str, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the fused GEMV takes this call: Triton serves x, decode-sized rows, one dtype, unit strides,
    and the table marks the shape ``"use": true`` (or the "triton" backend forces Triton)."""
    if kind not in KINDS:
        raise ValueError(f"gemma_gemv: kind {kind!r} not in {KINDS}")
    k = weight.shape[1]
    if x.dim() != 2 or weight.dim() != 2 or x.shape[0] == 0 or not ops.use_triton(x):
        return False
    if x.shape[1] != (2 * k if kind == "geglu" else k) or weight.dtype != x.dtype:
        return False
    if x.stride(1) != 1 or weight.stride(1) != 1:
        return False
    cfg = config(kind, x.shape[0], weight.shape[0], k, x.device)
    return x.shape[0] <= cfg["max_rows"] and (cfg["use"] or ops.get_backend() == "triton")


def gemma_gemv(kind: str, x: torch.Tensor, weight: torch.Tensor, cap: float | None = None) -> torch.Tensor:
    """``geglu``: x [M, 2K] -> [M, N] in x's dtype; ``softcap``: x [M, K] -> float32 [M, N] capped at ``cap``."""
    rows, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    geglu = kind == "geglu"
    if x.shape[1] != (2 * k if geglu else k) or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"gemma_gemv {kind}: x {tuple(x.shape)} / weight {tuple(weight.shape)} do not fit")
    if not geglu and not cap:
        raise ValueError("gemma_gemv softcap needs a cap")
    out = torch.empty(rows, n, dtype=x.dtype if geglu else torch.float32, device=x.device)
    if rows == 0:
        return out
    cfg = config(kind, rows, n, k, x.device)
    row_block = next_power_of_2(rows)
    block_k = cfg["BLOCK_K"] or (512 if row_block == 1 else 64)
    block_k = min(block_k, max(16, next_power_of_2(k)))
    _gemma_gemv_kernel[(cdiv(n, cfg["BLOCK_N"]),)](
        x, weight, out, rows, n, k, x.stride(0), weight.stride(0), out.stride(0), float(cap or 1.0),
        GEGLU=geglu, SOFTCAP=not geglu, ROWS=row_block, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=block_k,
        EVEN_K=k % block_k == 0, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **launch_options(x.device))
    return out
