"""Decode-shaped MoE expert GEMMs: few (token, slot) pairs, so the cost is streaming expert weights.

No sorting: program (j, n) owns pair j's expert if j is that expert's first pair, streams one
BLOCK_N-wide tile of the expert's weight rows once, and multiplies it against the pairs routed to
that expert, gathered into ROWS MMA rows (ROWS >= the most pairs one expert can get: a token picks
an expert at most once, so min(T, pairs), padded to 16). Each weight byte of the chosen experts is
read once whatever the batch.
"""
from __future__ import annotations

import triton
import triton.language as tl

ACT_SILU = 0
ACT_RELU2 = 1
ACT_GELU_TANH = 2  # Gemma 4's experts


@triton.jit
def _activation(x, ACTIVATION: tl.constexpr):
    if ACTIVATION == 0:
        return x * tl.sigmoid(x)
    elif ACTIVATION == 1:
        relu = tl.maximum(x, 0.0)
        return relu * relu
    else:  # gelu_tanh(x) = x · sigmoid(2·sqrt(2/pi)·(x + 0.044715·x³))
        return x * tl.sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x))


@triton.jit
def _owned_pairs(ids_ptr, num_pairs, PAIRS: tl.constexpr, ROWS: tl.constexpr):
    """(does this program own the expert, the expert, pair of each MMA row [ROWS], row in use [ROWS])."""
    pair = tl.program_id(0)
    offs = tl.arange(0, PAIRS)
    ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
    expert = tl.load(ids_ptr + pair)
    served = ids == expert  # [PAIRS]
    first = tl.min(tl.where(served, offs, PAIRS), axis=0)
    # row r takes the r-th served pair: a one-hot over the (few) pairs instead of a gather
    order = tl.cumsum(served.to(tl.int32), axis=0) - 1  # [PAIRS]
    rows = tl.arange(0, ROWS)
    hit = served[None, :] & (order[None, :] == rows[:, None])  # [ROWS, PAIRS]
    row_pair = tl.sum(tl.where(hit, offs[None, :], 0), axis=1)  # [ROWS]
    row_ok = rows < tl.sum(served.to(tl.int32), axis=0)
    return first == pair, expert, row_pair, row_ok


@triton.jit
def _expert_tile_dot(a_ptrs, w_ptrs, up_step, K, acc, acc_up, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                     GATED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc += a @ w over K (and acc_up += a @ w_up, w_up = w shifted by ``up_step`` rows, when GATED).

    a_ptrs: [M, BLOCK_K] pointers; w_ptrs: [BLOCK_K, N] pointers into one expert's weights.
    """
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
            if GATED:
                w_up = tl.load(w_ptrs + up_step)
        else:
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
            if GATED:
                w_up = tl.load(w_ptrs + up_step, mask=k_ok[:, None], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        if GATED:
            acc_up = tl.dot(a, w_up, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc, acc_up


@triton.jit
def moe_decode_up_kernel(
    x_ptr,
    w_ptr,
    ids_ptr,
    out_ptr,
    num_pairs,
    N,
    K,
    up_offset,
    stride_xm,
    stride_we,
    stride_wn,
    stride_om,
    TOP_K: tl.constexpr,
    GATED: tl.constexpr,
    ACTIVATION: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PAIRS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[p, n] = act(x[p // k] · W[e, n]) (· x[p // k] · W[e, up_offset + n] when gated), p served by e."""
    owner, expert, row_pair, row_ok = _owned_pairs(ids_ptr, num_pairs, PAIRS, ROWS)
    if owner:
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        safe_n = offs_n % N  # clamped rows keep the weight loads unmasked; their columns are not stored
        offs_k = tl.arange(0, BLOCK_K)
        tokens = row_pair // TOP_K  # unused rows read token 0 and are not stored
        x_ptrs = x_ptr + tokens[:, None] * stride_xm + offs_k[None, :]  # [ROWS, BLOCK_K]
        w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + safe_n[None, :] * stride_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
        acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        acc, acc_up = _expert_tile_dot(x_ptrs, w_ptrs, up_offset * stride_wn, K, acc, acc_up, BLOCK_K, EVEN_K, GATED,
                                       DOT_PRECISION)
        h = _activation(acc, ACTIVATION)
        if GATED:
            h = h * acc_up
        out_ptrs = out_ptr + row_pair[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, h.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < N))


@triton.jit
def moe_decode_down_kernel(
    h_ptr,
    w_ptr,
    ids_ptr,
    pair_weights_ptr,
    out_ptr,
    num_pairs,
    N,
    K,
    stride_hm,
    stride_we,
    stride_wn,
    stride_om,
    EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PAIRS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[p, n] = weight[p] · (h[p] · W2[e, n]) for the pairs p served by expert e."""
    owner, expert, row_pair, row_ok = _owned_pairs(ids_ptr, num_pairs, PAIRS, ROWS)
    if owner:
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        safe_n = offs_n % N
        offs_k = tl.arange(0, BLOCK_K)
        h_ptrs = h_ptr + row_pair[:, None] * stride_hm + offs_k[None, :]  # [ROWS, BLOCK_K]
        w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + safe_n[None, :] * stride_wn + offs_k[:, None]
        acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        acc, _ = _expert_tile_dot(h_ptrs, w_ptrs, 0, K, acc, acc, BLOCK_K, EVEN_K, False, DOT_PRECISION)
        scale = tl.load(pair_weights_ptr + row_pair, mask=row_ok, other=0.0).to(tl.float32)
        acc = acc * scale[:, None]
        out_ptrs = out_ptr + row_pair[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < N))
