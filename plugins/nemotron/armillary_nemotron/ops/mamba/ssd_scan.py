"""Mamba-2 SSD chunked scan in Triton over packed variable-length sequences, from and back into slot states (prefill).

A program owns one (sequence, head, BLOCK_P columns of the head) and walks that sequence's chunks
of ``CHUNK`` tokens in order, keeping its [BLOCK_P, N] fp32 state tile in registers: per chunk the
intra-chunk term (C·Bᵀ masked by the decay, times x·dt), the inter-chunk term (C·Sᵀ scaled by the
decay from the chunk start), the D skip, then the state hand-over S <- e^{Σa}·S + (x·dt·decay-to-end)ᵀ·B.
The chunk size is the kernel's choice (the math is exact for any), the loop bound is read on the
device, and the grid is (B, H, P / BLOCK_P): no host lists, so the call also works inside a CUDA
graph. Batches of at least ``chunked_min_tokens`` tokens take ``ssd_chunked`` instead (parallel
over chunks: a long prompt is otherwise one chain of chunk steps per head). Reference:
``naive.ssd_chunk_scan_ref``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from armillary.kernels.triton.host import cdiv, next_power_of_2
from armillary.kernels.tuning import kernel_config

TUNING_PACKAGE = "armillary_nemotron"
# PASS_P / pass_warps: the chunked path's state hand-over; chunked_min_tokens: the smallest batch it takes
SCAN_DEFAULTS = {"CHUNK": 64, "BLOCK_P": 32, "num_warps": 4, "num_stages": 1, "PASS_P": 16, "pass_warps": 4,
                 "chunked_min_tokens": 256}


@triton.jit
def _ssd_scan_kernel(
    x_ptr, b_ptr, c_ptr, dt_ptr, a_log_ptr, d_ptr, dt_bias_ptr, states_ptr, slots_ptr, cu_ptr, y_ptr,
    stride_x, stride_dt, stride_y, stride_state, dt_min,
    HEADS_PER_GROUP: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    group = head // HEADS_PER_GROUP
    bos = tl.load(cu_ptr + seq).to(tl.int64)
    length = tl.load(cu_ptr + seq + 1).to(tl.int64) - bos
    slot = tl.load(slots_ptr + seq).to(tl.int64)

    cols = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    m_p = cols < P
    n = tl.arange(0, BLOCK_N)
    m_n = n < N
    state_ptrs = states_ptr + slot * stride_state + head * P * N + cols[:, None] * N + n[None, :]
    state = tl.load(state_ptrs, mask=m_p[:, None] & m_n[None, :], other=0.0).to(tl.float32)  # [BP, BN]

    a_head = -tl.exp(tl.load(a_log_ptr + head).to(tl.float32))  # A = -exp(A_log)
    d_head = tl.load(d_ptr + head).to(tl.float32)
    bias = tl.load(dt_bias_ptr + head).to(tl.float32)
    rows = tl.arange(0, CHUNK)
    causal = rows[:, None] >= rows[None, :]
    for start in range(0, length, CHUNK):
        t = start + rows
        m_t = t < length
        tok = bos + t
        raw = tl.load(dt_ptr + tok * stride_dt + head, mask=m_t, other=0.0).to(tl.float32) + bias
        dt = tl.where(raw > 20.0, raw, tl.log(1.0 + tl.exp(raw)))  # softplus, as torch (threshold 20)
        dt = tl.where(m_t, tl.maximum(dt, dt_min), 0.0)  # padded steps: no decay, no input
        a_cs = tl.cumsum(dt * a_head, axis=0)  # [L] log decay from the chunk start
        a_total = tl.sum(dt * a_head, axis=0)

        xv = tl.load(x_ptr + tok[:, None] * stride_x + head * P + cols[None, :],
                     mask=m_t[:, None] & m_p[None, :], other=0.0)  # [L, BP]
        bv = tl.load(b_ptr + tok[:, None] * stride_x + group * N + n[None, :],
                     mask=m_t[:, None] & m_n[None, :], other=0.0)  # [L, BN]
        cv = tl.load(c_ptr + tok[:, None] * stride_x + group * N + n[None, :],
                     mask=m_t[:, None] & m_n[None, :], other=0.0)

        cb = tl.dot(cv, tl.trans(bv), input_precision=PRECISION)  # [L, L]
        decay = tl.where(causal, tl.exp(a_cs[:, None] - a_cs[None, :]), 0.0)
        weights = cb * decay * dt[None, :]
        y = tl.dot(weights.to(xv.dtype), xv, input_precision=PRECISION)  # [L, BP] intra-chunk
        y_off = tl.dot(cv, tl.trans(state.to(cv.dtype)), input_precision=PRECISION)  # [L, BP]
        y += y_off * tl.exp(a_cs)[:, None]
        y += d_head * xv.to(tl.float32)
        tl.store(y_ptr + tok[:, None] * stride_y + head * P + cols[None, :], y.to(y_ptr.dtype.element_ty),
                 mask=m_t[:, None] & m_p[None, :])

        to_end = tl.where(m_t, dt * tl.exp(a_total - a_cs), 0.0)  # [L]
        xw = (xv.to(tl.float32) * to_end[:, None]).to(bv.dtype)
        state = state * tl.exp(a_total) + tl.dot(tl.trans(xw), bv, input_precision=PRECISION)  # [BP, BN]
    tl.debug_barrier()  # every thread's load of the old tile comes before any thread overwrites it
    tl.store(state_ptrs, state.to(states_ptr.dtype.element_ty), mask=m_p[:, None] & m_n[None, :])


def _rows_contiguous(states: torch.Tensor) -> bool:
    """Each slot's [H, P, N] contiguous (the pool keeps every layer of a slot in one row, so slots are strided)."""
    _, h, p, n = states.shape
    return states.stride(3) == 1 and states.stride(2) == n and states.stride(1) == p * n


def scan_config(device: torch.device | None = None) -> dict:
    return kernel_config(TUNING_PACKAGE, "mamba_ssd_scan", "default", SCAN_DEFAULTS, device)


def ssd_chunk_scan(x: torch.Tensor, B: torch.Tensor, C: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor,
                   D: torch.Tensor, dt_bias: torch.Tensor, dt_min: float, cu_seqlens: torch.Tensor,
                   ssm_states: torch.Tensor, state_slots: torch.Tensor, heads: int, head_dim: int,
                   out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """x [T, H·P], B, C [T, G·N] (column views of the conv output, one row stride), dt [T, H] raw
    (a view is fine), A_log [H] fp32 (A = -exp(A_log), taken in the kernels), D, dt_bias [H];
    cu_seqlens [B+1] int32 on the device; ssm_states [slots, H, P, N] (each slot contiguous), updated at ``state_slots`` [B].
    Returns y [T, H·P] in x's dtype (or into ``out``)."""
    num_tokens = x.shape[0]
    groups_n = B.shape[1]
    n_state = ssm_states.shape[-1]
    groups = groups_n // n_state
    if not (x.stride(0) == B.stride(0) == C.stride(0) and x.stride(1) == B.stride(1) == C.stride(1) == 1):
        raise ValueError("ssd_chunk_scan: x, B and C must be unit-stride column views with one row stride")
    if ssm_states.shape[1:] != (heads, head_dim, n_state) or not _rows_contiguous(ssm_states):
        raise ValueError(f"ssd_chunk_scan: ssm_states {tuple(ssm_states.shape)} is not [slots, {heads}, {head_dim}, N]")
    if dt.stride(1) != 1:
        raise ValueError("ssd_chunk_scan: dt needs unit stride along heads")
    y = out if out is not None else torch.empty(num_tokens, heads * head_dim, dtype=x.dtype, device=x.device)
    num_seqs = state_slots.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return y
    cfg = {**scan_config(x.device), **(config or {})}
    if num_tokens >= cfg["chunked_min_tokens"]:
        from armillary_nemotron.ops.mamba.ssd_chunked import ssd_chunked_scan

        return ssd_chunked_scan(x, B, C, dt, A_log, D, dt_bias, dt_min, cu_seqlens, ssm_states, state_slots, heads,
                                head_dim, y, cfg)
    block_p = min(cfg["BLOCK_P"], max(16, next_power_of_2(head_dim)))
    grid = (num_seqs, heads, cdiv(head_dim, block_p))
    _ssd_scan_kernel[grid](
        x, B, C, dt, A_log, D, dt_bias, ssm_states, state_slots, cu_seqlens, y,
        x.stride(0), dt.stride(0), y.stride(0), ssm_states.stride(0), float(dt_min),
        HEADS_PER_GROUP=heads // groups, P=head_dim, N=n_state, CHUNK=cfg["CHUNK"], BLOCK_P=block_p,
        BLOCK_N=max(16, next_power_of_2(n_state)),
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return y
