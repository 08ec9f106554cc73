"""Chunked gated delta rule, the across-chunk half: the state recurrence over a sequence's chunks
and the per-chunk outputs.

With S the state at a chunk's start, c the chunk's cumulative log2 decay (c_L its last value):
    deltas  D = u - w S
    S'      = 2^c_L S + (2^(c_L - c) k)^T D
    o       = scale · (2^c q S + (q k^T ⊙ 2^(c_i - c_j), j <= i) D)
The recurrence is sequential per (sequence, value head, V tile) and stores each chunk's start state
for the output kernel, which is parallel over chunks.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def chunk_state_kernel(
    k, w, u, g_cum, cu_seqlens, first_chunk, h0, ht, state_index, chunk_states, deltas, stride_k, stride_h0, stride_ht,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    HAS_INITIAL: tl.constexpr, HAS_INDEX: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One (V tile, sequence · value head): chunk_states [chunks, HV, K, V] and deltas [T, HV, V];
    reads the start state from h0[index] and writes the final one to ht[index] (index = slot or n);
    a state row may be strided (rows of the flat state buffer), each row's [HV, K, V] contiguous."""
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    seq = i_nh // HV
    i_h = i_nh % HV
    bos = tl.load(cu_seqlens + seq).to(tl.int64)
    seq_len = (tl.load(cu_seqlens + seq + 1) - bos).to(tl.int32)
    chunk0 = tl.load(first_chunk + seq).to(tl.int64)
    if HAS_INDEX:
        index = tl.load(state_index + seq).to(tl.int64)
    else:
        index = seq.to(tl.int64)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]
    tile = i_h * K * V + o_k[:, None] * V + o_v[None, :]  # [BK, BV] inside one [HV, K, V] state
    if HAS_INITIAL:
        s = tl.load(h0 + index * stride_h0 + tile, mask=m_kv, other=0.0).to(tl.float32)
    else:
        s = tl.zeros([BK, BV], dtype=tl.float32)

    k += (i_h // (HV // H)) * K
    dt = chunk_states.dtype.element_ty
    rows = tl.arange(0, BT)
    for i in range(tl.cdiv(seq_len, BT)):
        tl.store(chunk_states + (chunk0 + i) * HV * K * V + tile, s.to(dt), mask=m_kv)
        m_t = i * BT + rows < seq_len
        tok = bos + i * BT + rows
        m_tk = m_t[:, None] & (o_k < K)[None, :]
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        b_w = tl.load(w + tok[:, None] * (HV * K) + i_h * K + o_k[None, :], mask=m_tk, other=0.0)
        b_u = tl.load(u + tok[:, None] * (HV * V) + i_h * V + o_v[None, :], mask=m_tv, other=0.0)
        d = b_u.to(tl.float32) - tl.dot(b_w, s.to(dt), input_precision=DOT_PRECISION)  # [BT, BV]
        tl.store(deltas + tok[:, None] * (HV * V) + i_h * V + o_v[None, :], d.to(dt), mask=m_tv)
        c = tl.load(g_cum + tok * HV + i_h, mask=m_t, other=0.0)
        c_last = tl.load(g_cum + (bos + tl.minimum(i * BT + BT, seq_len) - 1) * HV + i_h)
        d = tl.where(m_t[:, None], d * tl.exp2(c_last - c)[:, None], 0.0)
        b_kt = tl.load(k + tok[None, :] * stride_k + o_k[:, None], mask=(o_k < K)[:, None] & m_t[None, :], other=0.0)
        s = s * tl.exp2(c_last) + tl.dot(b_kt, d.to(dt), input_precision=DOT_PRECISION)
    tl.store(ht + index * stride_ht + tile, s, mask=m_kv)


@triton.jit
def chunk_output_kernel(
    q, k, deltas, chunk_states, g_cum, cu_seqlens, chunk_table, o, stride_q, stride_k, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One (V tile, chunk, value head): o [T, HV, V]."""
    i_v = tl.program_id(0)
    i_chunk = tl.program_id(1)
    i_h = tl.program_id(2)
    seq = tl.load(chunk_table + 2 * i_chunk)
    t0 = tl.load(chunk_table + 2 * i_chunk + 1) * BT
    bos = tl.load(cu_seqlens + seq).to(tl.int64)
    seq_len = (tl.load(cu_seqlens + seq + 1) - bos).to(tl.int32)
    rows = tl.arange(0, BT)
    m_t = t0 + rows < seq_len
    tok = bos + t0 + rows
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    q += (i_h // (HV // H)) * K
    k += (i_h // (HV // H)) * K
    chunk_states += i_chunk.to(tl.int64) * HV * K * V + i_h * K * V

    acc = tl.zeros([BT, BV], dtype=tl.float32)
    scores = tl.zeros([BT, BT], dtype=tl.float32)
    for k_start in range(0, K, BK):
        cols = k_start + tl.arange(0, BK)
        m_c = cols < K
        b_q = tl.load(q + tok[:, None] * stride_q + cols[None, :], mask=m_t[:, None] & m_c[None, :], other=0.0)
        b_kt = tl.load(k + tok[None, :] * stride_k + cols[:, None], mask=m_c[:, None] & m_t[None, :], other=0.0)
        b_s = tl.load(chunk_states + cols[:, None] * V + o_v[None, :], mask=m_c[:, None] & m_v[None, :], other=0.0)
        acc += tl.dot(b_q, b_s, input_precision=DOT_PRECISION)
        scores += tl.dot(b_q, b_kt, input_precision=DOT_PRECISION)
    c = tl.load(g_cum + tok * HV + i_h, mask=m_t, other=0.0)
    acc = acc * tl.exp2(c)[:, None]
    causal = (rows[:, None] >= rows[None, :]) & m_t[:, None]
    scores = tl.where(causal, scores * tl.exp2(c[:, None] - c[None, :]), 0.0)
    m_tv = m_t[:, None] & m_v[None, :]
    b_d = tl.load(deltas + tok[:, None] * (HV * V) + i_h * V + o_v[None, :], mask=m_tv, other=0.0)
    acc += tl.dot(scores.to(b_d.dtype), b_d, input_precision=DOT_PRECISION)
    tl.store(o + tok[:, None] * (HV * V) + i_h * V + o_v[None, :], (acc * scale).to(o.dtype.element_ty), mask=m_tv)
