"""Chunked gated delta rule, the per-chunk half: q/k L2 norm, and for each 64-token chunk the
cumulative decay, the WY system and its inverse, and the recomputed w, u.

Inside a chunk with cumulative log decay c and betas b, the deltas solve (I + A) U = ... with
A_ij = b_i exp(c_i - c_j) k_i·k_j for j < i. The chunk is four blocks of 16 tokens: the four
diagonal blocks of X = (I + A)^-1 come from forward substitution, row by row and all four at once;
the off-diagonal blocks from block forward substitution with products, X_ij = -X_ii sum_j<=l<i A_il X_lj.
Then w = X (b exp(c) k) and u = X (b v), so that the deltas are u - w S0. Everything stays in
registers. Decays are kept in the log2 domain (cumsum · log2 e) so every exponential is an exp2.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def l2norm_qk_kernel(
    q, k, q_out, k_out, stride_q, stride_k, num_tokens,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """q, k: [T, H, K] rows (token stride given) -> x · rsqrt(sum x² + 1e-6), contiguous [T, H, K]."""
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    i_h = tl.program_id(1)
    cols = tl.arange(0, BK)
    mask = (tok < num_tokens)[:, None] & (cols < K)[None, :]
    tok = tok.to(tl.int64)
    dst = tok[:, None] * (H * K) + i_h * K + cols[None, :]
    x = tl.load(q + tok[:, None] * stride_q + i_h * K + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x = x * tl.rsqrt(tl.sum(x * x, 1) + 1e-6)[:, None]
    tl.store(q_out + dst, x.to(q_out.dtype.element_ty), mask=mask)
    x = tl.load(k + tok[:, None] * stride_k + i_h * K + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x = x * tl.rsqrt(tl.sum(x * x, 1) + 1e-6)[:, None]
    tl.store(k_out + dst, x.to(k_out.dtype.element_ty), mask=mask)


@triton.jit
def chunk_intra_kernel(
    k, v, g, beta, cu_seqlens, chunk_table, w, u, g_cum, stride_k, stride_v,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One (chunk, value head): writes g_cum [T, HV] (log2 domain), w [T, HV, K], u [T, HV, V]."""
    BC: tl.constexpr = BT // 4
    i_chunk = tl.program_id(0)
    i_h = tl.program_id(1)
    k += (i_h // (HV // H)) * K
    v += i_h * V
    seq = tl.load(chunk_table + 2 * i_chunk)
    t0 = tl.load(chunk_table + 2 * i_chunk + 1) * BT
    bos = tl.load(cu_seqlens + seq).to(tl.int64)
    seq_len = (tl.load(cu_seqlens + seq + 1) - bos).to(tl.int32)

    # the chunk's four 16-token blocks: tokens, masks, log2 cumulative decays, betas
    rows = tl.arange(0, BC)
    m0 = t0 + rows < seq_len
    m1 = t0 + BC + rows < seq_len
    m2 = t0 + 2 * BC + rows < seq_len
    m3 = t0 + 3 * BC + rows < seq_len
    tok0 = bos + t0 + rows
    tok1 = tok0 + BC
    tok2 = tok0 + 2 * BC
    tok3 = tok0 + 3 * BC
    g0 = tl.load(g + tok0 * HV + i_h, mask=m0, other=0.0).to(tl.float32)
    g1 = tl.load(g + tok1 * HV + i_h, mask=m1, other=0.0).to(tl.float32)
    g2 = tl.load(g + tok2 * HV + i_h, mask=m2, other=0.0).to(tl.float32)
    g3 = tl.load(g + tok3 * HV + i_h, mask=m3, other=0.0).to(tl.float32)
    c0 = tl.cumsum(g0, 0)
    c1 = tl.cumsum(g1, 0) + tl.sum(g0, 0)
    c2 = tl.cumsum(g2, 0) + tl.sum(g0 + g1, 0)
    c3 = tl.cumsum(g3, 0) + tl.sum(g0 + g1 + g2, 0)
    c0 *= 1.4426950408889634  # log2 e
    c1 *= 1.4426950408889634
    c2 *= 1.4426950408889634
    c3 *= 1.4426950408889634
    tl.store(g_cum + tok0 * HV + i_h, c0, mask=m0)
    tl.store(g_cum + tok1 * HV + i_h, c1, mask=m1)
    tl.store(g_cum + tok2 * HV + i_h, c2, mask=m2)
    tl.store(g_cum + tok3 * HV + i_h, c3, mask=m3)
    b0 = tl.load(beta + tok0 * HV + i_h, mask=m0, other=0.0).to(tl.float32)
    b1 = tl.load(beta + tok1 * HV + i_h, mask=m1, other=0.0).to(tl.float32)
    b2 = tl.load(beta + tok2 * HV + i_h, mask=m2, other=0.0).to(tl.float32)
    b3 = tl.load(beta + tok3 * HV + i_h, mask=m3, other=0.0).to(tl.float32)

    # the ten lower blocks of K K^T
    a00 = tl.zeros([BC, BC], dtype=tl.float32)
    a10 = tl.zeros([BC, BC], dtype=tl.float32)
    a11 = tl.zeros([BC, BC], dtype=tl.float32)
    a20 = tl.zeros([BC, BC], dtype=tl.float32)
    a21 = tl.zeros([BC, BC], dtype=tl.float32)
    a22 = tl.zeros([BC, BC], dtype=tl.float32)
    a30 = tl.zeros([BC, BC], dtype=tl.float32)
    a31 = tl.zeros([BC, BC], dtype=tl.float32)
    a32 = tl.zeros([BC, BC], dtype=tl.float32)
    a33 = tl.zeros([BC, BC], dtype=tl.float32)
    for k_start in range(0, K, BK):
        cols = k_start + tl.arange(0, BK)
        m_c = (cols < K)[None, :]
        k0 = tl.load(k + tok0[:, None] * stride_k + cols[None, :], mask=m0[:, None] & m_c, other=0.0)
        k1 = tl.load(k + tok1[:, None] * stride_k + cols[None, :], mask=m1[:, None] & m_c, other=0.0)
        k2 = tl.load(k + tok2[:, None] * stride_k + cols[None, :], mask=m2[:, None] & m_c, other=0.0)
        k3 = tl.load(k + tok3[:, None] * stride_k + cols[None, :], mask=m3[:, None] & m_c, other=0.0)
        a00 += tl.dot(k0, tl.trans(k0), input_precision=DOT_PRECISION)
        a10 += tl.dot(k1, tl.trans(k0), input_precision=DOT_PRECISION)
        a11 += tl.dot(k1, tl.trans(k1), input_precision=DOT_PRECISION)
        a20 += tl.dot(k2, tl.trans(k0), input_precision=DOT_PRECISION)
        a21 += tl.dot(k2, tl.trans(k1), input_precision=DOT_PRECISION)
        a22 += tl.dot(k2, tl.trans(k2), input_precision=DOT_PRECISION)
        a30 += tl.dot(k3, tl.trans(k0), input_precision=DOT_PRECISION)
        a31 += tl.dot(k3, tl.trans(k1), input_precision=DOT_PRECISION)
        a32 += tl.dot(k3, tl.trans(k2), input_precision=DOT_PRECISION)
        a33 += tl.dot(k3, tl.trans(k3), input_precision=DOT_PRECISION)
    # A_ij = b_i 2^(c_i - c_j) k_i·k_j below the diagonal; where() first, so an overflowing exp2
    # above it never reaches a product
    lower = rows[:, None] > rows[None, :]
    a00 = tl.where(lower & m0[:, None], a00 * tl.exp2(c0[:, None] - c0[None, :]), 0.0) * b0[:, None]
    a11 = tl.where(lower & m1[:, None], a11 * tl.exp2(c1[:, None] - c1[None, :]), 0.0) * b1[:, None]
    a22 = tl.where(lower & m2[:, None], a22 * tl.exp2(c2[:, None] - c2[None, :]), 0.0) * b2[:, None]
    a33 = tl.where(lower & m3[:, None], a33 * tl.exp2(c3[:, None] - c3[None, :]), 0.0) * b3[:, None]
    a10 = tl.where(m1[:, None], a10 * tl.exp2(c1[:, None] - c0[None, :]), 0.0) * b1[:, None]
    a20 = tl.where(m2[:, None], a20 * tl.exp2(c2[:, None] - c0[None, :]), 0.0) * b2[:, None]
    a21 = tl.where(m2[:, None], a21 * tl.exp2(c2[:, None] - c1[None, :]), 0.0) * b2[:, None]
    a30 = tl.where(m3[:, None], a30 * tl.exp2(c3[:, None] - c0[None, :]), 0.0) * b3[:, None]
    a31 = tl.where(m3[:, None], a31 * tl.exp2(c3[:, None] - c1[None, :]), 0.0) * b3[:, None]
    a32 = tl.where(m3[:, None], a32 * tl.exp2(c3[:, None] - c2[None, :]), 0.0) * b3[:, None]

    # diagonal blocks of the inverse, row by row: N_i = -A_i - sum_j A_ij N_j (rows j < i final);
    # rows past the sequence end are zero in every block and need no step
    n0 = tl.zeros([BC, BC], dtype=tl.float32)
    n1 = tl.zeros([BC, BC], dtype=tl.float32)
    n2 = tl.zeros([BC, BC], dtype=tl.float32)
    n3 = tl.zeros([BC, BC], dtype=tl.float32)
    for i in range(1, tl.minimum(seq_len - t0, BC)):
        sel = (rows == i)[:, None]
        r0 = tl.sum(tl.where(sel, a00, 0.0), 0)
        r1 = tl.sum(tl.where(sel, a11, 0.0), 0)
        r2 = tl.sum(tl.where(sel, a22, 0.0), 0)
        r3 = tl.sum(tl.where(sel, a33, 0.0), 0)
        r0 = -r0 - tl.sum(r0[:, None] * n0, 0)
        r1 = -r1 - tl.sum(r1[:, None] * n1, 0)
        r2 = -r2 - tl.sum(r2[:, None] * n2, 0)
        r3 = -r3 - tl.sum(r3[:, None] * n3, 0)
        n0 = tl.where(sel, r0[None, :], n0)
        n1 = tl.where(sel, r1[None, :], n1)
        n2 = tl.where(sel, r2[None, :], n2)
        n3 = tl.where(sel, r3[None, :], n3)
    eye = (rows[:, None] == rows[None, :]).to(tl.float32)
    x00 = n0 + eye
    x11 = n1 + eye
    x22 = n2 + eye
    x33 = n3 + eye
    # off-diagonal blocks by block forward substitution
    x10 = -tl.dot(tl.dot(x11, a10, input_precision=DOT_PRECISION), x00, input_precision=DOT_PRECISION)
    x21 = -tl.dot(tl.dot(x22, a21, input_precision=DOT_PRECISION), x11, input_precision=DOT_PRECISION)
    x32 = -tl.dot(tl.dot(x33, a32, input_precision=DOT_PRECISION), x22, input_precision=DOT_PRECISION)
    x20 = -tl.dot(x22, tl.dot(a20, x00, input_precision=DOT_PRECISION)
                  + tl.dot(a21, x10, input_precision=DOT_PRECISION), input_precision=DOT_PRECISION)
    x31 = -tl.dot(x33, tl.dot(a31, x11, input_precision=DOT_PRECISION)
                  + tl.dot(a32, x21, input_precision=DOT_PRECISION), input_precision=DOT_PRECISION)
    x30 = -tl.dot(x33, tl.dot(a30, x00, input_precision=DOT_PRECISION)
                  + tl.dot(a31, x10, input_precision=DOT_PRECISION)
                  + tl.dot(a32, x20, input_precision=DOT_PRECISION), input_precision=DOT_PRECISION)

    dt = w.dtype.element_ty
    x00, x10, x11 = x00.to(dt), x10.to(dt), x11.to(dt)
    x20, x21, x22 = x20.to(dt), x21.to(dt), x22.to(dt)
    x30, x31, x32, x33 = x30.to(dt), x31.to(dt), x32.to(dt), x33.to(dt)
    ks0 = b0 * tl.exp2(c0)
    ks1 = b1 * tl.exp2(c1)
    ks2 = b2 * tl.exp2(c2)
    ks3 = b3 * tl.exp2(c3)
    for k_start in range(0, K, BK):
        cols = k_start + tl.arange(0, BK)
        m_c = (cols < K)[None, :]
        k0 = tl.load(k + tok0[:, None] * stride_k + cols[None, :], mask=m0[:, None] & m_c, other=0.0)
        k1 = tl.load(k + tok1[:, None] * stride_k + cols[None, :], mask=m1[:, None] & m_c, other=0.0)
        k2 = tl.load(k + tok2[:, None] * stride_k + cols[None, :], mask=m2[:, None] & m_c, other=0.0)
        k3 = tl.load(k + tok3[:, None] * stride_k + cols[None, :], mask=m3[:, None] & m_c, other=0.0)
        k0 = (k0.to(tl.float32) * ks0[:, None]).to(dt)
        k1 = (k1.to(tl.float32) * ks1[:, None]).to(dt)
        k2 = (k2.to(tl.float32) * ks2[:, None]).to(dt)
        k3 = (k3.to(tl.float32) * ks3[:, None]).to(dt)
        o0 = tl.dot(x00, k0, input_precision=DOT_PRECISION)
        o1 = tl.dot(x10, k0, input_precision=DOT_PRECISION) + tl.dot(x11, k1, input_precision=DOT_PRECISION)
        o2 = tl.dot(x20, k0, input_precision=DOT_PRECISION) + tl.dot(x21, k1, input_precision=DOT_PRECISION)
        o2 += tl.dot(x22, k2, input_precision=DOT_PRECISION)
        o3 = tl.dot(x30, k0, input_precision=DOT_PRECISION) + tl.dot(x31, k1, input_precision=DOT_PRECISION)
        o3 += tl.dot(x32, k2, input_precision=DOT_PRECISION) + tl.dot(x33, k3, input_precision=DOT_PRECISION)
        p_w = w + i_h * K + cols[None, :]
        tl.store(p_w + tok0[:, None] * (HV * K), o0.to(dt), mask=m0[:, None] & m_c)
        tl.store(p_w + tok1[:, None] * (HV * K), o1.to(dt), mask=m1[:, None] & m_c)
        tl.store(p_w + tok2[:, None] * (HV * K), o2.to(dt), mask=m2[:, None] & m_c)
        tl.store(p_w + tok3[:, None] * (HV * K), o3.to(dt), mask=m3[:, None] & m_c)
    for v_start in range(0, V, BV):
        cols = v_start + tl.arange(0, BV)
        m_c = (cols < V)[None, :]
        v0 = tl.load(v + tok0[:, None] * stride_v + cols[None, :], mask=m0[:, None] & m_c, other=0.0)
        v1 = tl.load(v + tok1[:, None] * stride_v + cols[None, :], mask=m1[:, None] & m_c, other=0.0)
        v2 = tl.load(v + tok2[:, None] * stride_v + cols[None, :], mask=m2[:, None] & m_c, other=0.0)
        v3 = tl.load(v + tok3[:, None] * stride_v + cols[None, :], mask=m3[:, None] & m_c, other=0.0)
        v0 = (v0.to(tl.float32) * b0[:, None]).to(dt)
        v1 = (v1.to(tl.float32) * b1[:, None]).to(dt)
        v2 = (v2.to(tl.float32) * b2[:, None]).to(dt)
        v3 = (v3.to(tl.float32) * b3[:, None]).to(dt)
        o0 = tl.dot(x00, v0, input_precision=DOT_PRECISION)
        o1 = tl.dot(x10, v0, input_precision=DOT_PRECISION) + tl.dot(x11, v1, input_precision=DOT_PRECISION)
        o2 = tl.dot(x20, v0, input_precision=DOT_PRECISION) + tl.dot(x21, v1, input_precision=DOT_PRECISION)
        o2 += tl.dot(x22, v2, input_precision=DOT_PRECISION)
        o3 = tl.dot(x30, v0, input_precision=DOT_PRECISION) + tl.dot(x31, v1, input_precision=DOT_PRECISION)
        o3 += tl.dot(x32, v2, input_precision=DOT_PRECISION) + tl.dot(x33, v3, input_precision=DOT_PRECISION)
        p_u = u + i_h * V + cols[None, :]
        tl.store(p_u + tok0[:, None] * (HV * V), o0.to(dt), mask=m0[:, None] & m_c)
        tl.store(p_u + tok1[:, None] * (HV * V), o1.to(dt), mask=m1[:, None] & m_c)
        tl.store(p_u + tok2[:, None] * (HV * V), o2.to(dt), mask=m2[:, None] & m_c)
        tl.store(p_u + tok3[:, None] * (HV * V), o3.to(dt), mask=m3[:, None] & m_c)
