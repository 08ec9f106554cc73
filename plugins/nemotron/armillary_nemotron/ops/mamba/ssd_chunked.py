"""Mamba-2 SSD scan parallel over chunks (long prefills): chunk states, a sequential state hand-over, chunk outputs; three Triton launches.

The serial scan (``ssd_scan``) walks a sequence's chunks in one program per (sequence, head,
columns), so a 16K prompt is a chain of 256 chunk steps on 128 programs. Here the two heavy
passes run one program per (chunk, head, columns) of every sequence at once:

1. ``_chunk_state_kernel``: each chunk's own end-state contribution Σ_l (x·dt·e^{a_end - a_l}) ⊗ B
   [P, N] fp32 into scratch, and its total log decay a_end;
2. ``_state_pass_kernel``: per (sequence, head, rows) the only sequential part, elementwise:
   S_start(c) = S; S <- e^{a_end(c)}·S + contribution(c), from and back into the slot state, each
   chunk's start state written over its contribution in scratch;
3. ``_chunk_scan_kernel``: y = (C·Bᵀ ∘ decay)·(x·dt) + (C·S_startᵀ)·e^{a_l} + D·x per chunk.

Chunks are numbered over the packed batch in sequence order; every program finds its sequence
from ``cu_seqlens`` on the device (a cumulative count of chunks per sequence), and the grids are
upper bounds that follow the token and sequence counts (programs past the last chunk do nothing),
so nothing is read back to the host. Reference: ``naive.ssd_chunk_scan_ref``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from armillary.kernels.triton.host import cdiv, next_power_of_2


@triton.jit
def _seq_chunks(cu_ptr, num_seqs, BLOCK_S: tl.constexpr, CHUNK: tl.constexpr):
    """Per sequence [BLOCK_S]: first token, token count, index of its first chunk, chunk count."""
    s = tl.arange(0, BLOCK_S)
    m = s < num_seqs
    lo = tl.load(cu_ptr + s, mask=m, other=0)
    hi = tl.load(cu_ptr + s + 1, mask=m, other=0)
    counts = (hi - lo + CHUNK - 1) // CHUNK
    ends = tl.cumsum(counts, axis=0)  # inclusive: padding entries carry the total
    return s, lo, hi - lo, ends - counts, counts, ends


@triton.jit
def _chunk_of(cu_ptr, num_seqs, chunk, BLOCK_S: tl.constexpr, CHUNK: tl.constexpr):
    """(first token of ``chunk``, its token count): 0 tokens past the batch's last chunk."""
    s, lo, lengths, firsts, counts, ends = _seq_chunks(cu_ptr, num_seqs, BLOCK_S, CHUNK)
    seq = tl.sum((ends <= chunk).to(tl.int32), axis=0)  # the first sequence whose chunks reach past ``chunk``
    pick = s == seq
    k = chunk - tl.sum(tl.where(pick, firsts, 0), axis=0)
    start = k * CHUNK
    length = tl.sum(tl.where(pick, lengths, 0), axis=0) - start
    bos = tl.sum(tl.where(pick, lo, 0), axis=0).to(tl.int64) + start
    return bos, tl.minimum(tl.maximum(length, 0), CHUNK)


@triton.jit
def _chunk_dt(dt_ptr, stride_dt, a_log_ptr, dt_bias_ptr, head, tok, m_t, dt_min):
    """dt = max(softplus(dt + dt_bias), dt_min) per row (0 on padded rows) and A = -exp(A_log)."""
    raw = tl.load(dt_ptr + tok * stride_dt + head, mask=m_t, other=0.0).to(tl.float32)
    raw += tl.load(dt_bias_ptr + head).to(tl.float32)
    dt = tl.where(raw > 20.0, raw, tl.log(1.0 + tl.exp(raw)))  # softplus, as torch (threshold 20)
    dt = tl.where(m_t, tl.maximum(dt, dt_min), 0.0)  # padded steps: no decay, no input
    return dt, -tl.exp(tl.load(a_log_ptr + head).to(tl.float32))


@triton.jit
def _chunk_state_kernel(
    x_ptr, b_ptr, dt_ptr, a_log_ptr, dt_bias_ptr, cu_ptr, contrib_ptr, decay_ptr, num_seqs, stride_x, stride_dt,
    dt_min, HEADS: tl.constexpr, HEADS_PER_GROUP: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
    PRECISION: tl.constexpr,
):
    chunk = tl.program_id(0)
    head = tl.program_id(1)
    group = head // HEADS_PER_GROUP
    bos, length = _chunk_of(cu_ptr, num_seqs, chunk, BLOCK_S, CHUNK)
    cols = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    m_p = cols < P
    n = tl.arange(0, BLOCK_N)
    m_n = n < N
    rows = tl.arange(0, CHUNK)
    m_t = rows < length
    tok = bos + rows
    dt, a_head = _chunk_dt(dt_ptr, stride_dt, a_log_ptr, dt_bias_ptr, head, tok, m_t, dt_min)
    a_cs = tl.cumsum(dt * a_head, axis=0)  # [L] log decay from the chunk start
    a_total = tl.sum(dt * a_head, axis=0)
    xv = tl.load(x_ptr + tok[:, None] * stride_x + head * P + cols[None, :], mask=m_t[:, None] & m_p[None, :],
                 other=0.0)  # [L, BP]
    bv = tl.load(b_ptr + tok[:, None] * stride_x + group * N + n[None, :], mask=m_t[:, None] & m_n[None, :],
                 other=0.0)  # [L, BN]
    to_end = tl.where(m_t, dt * tl.exp(a_total - a_cs), 0.0)  # [L]
    xw = (xv.to(tl.float32) * to_end[:, None]).to(bv.dtype)
    contrib = tl.dot(tl.trans(xw), bv, input_precision=PRECISION)  # [BP, BN]
    base = chunk.to(tl.int64) * (HEADS * P * N) + head * P * N
    tl.store(contrib_ptr + base + cols[:, None] * N + n[None, :], contrib, mask=m_p[:, None] & m_n[None, :])
    if tl.program_id(2) == 0:
        tl.store(decay_ptr + chunk.to(tl.int64) * HEADS + head, a_total)


@triton.jit
def _state_pass_kernel(
    states_ptr, slots_ptr, cu_ptr, contrib_ptr, decay_ptr, num_seqs, stride_state,
    HEADS: tl.constexpr, P: tl.constexpr, N: tl.constexpr, CHUNK: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s, _, _, firsts, counts, _ = _seq_chunks(cu_ptr, num_seqs, BLOCK_S, CHUNK)
    first = tl.sum(tl.where(s == seq, firsts, 0), axis=0).to(tl.int64)
    count = tl.sum(tl.where(s == seq, counts, 0), axis=0)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    cols = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    m = (cols < P)[:, None] & (n < N)[None, :]
    tile = head * P * N + cols[:, None] * N + n[None, :]  # [BP, BN] inside one chunk's [H, P, N]
    state_ptrs = states_ptr + slot * stride_state + tile
    state = tl.load(state_ptrs, mask=m, other=0.0).to(tl.float32)
    step = HEADS * P * N
    # two chunks ahead in flight; indices up to the batch's chunk count + 1 stay inside the scratch (its
    # row count is an upper bound with two to spare)
    ahead = tl.load(contrib_ptr + first * step + tile, mask=m, other=0.0)
    later = tl.load(contrib_ptr + (first + 1) * step + tile, mask=m, other=0.0)
    for k in range(0, count):
        chunk = first + k
        contrib = ahead
        ahead = later
        a_total = tl.load(decay_ptr + chunk * HEADS + head)
        later = tl.load(contrib_ptr + (chunk + 2) * step + tile, mask=m, other=0.0)
        tl.debug_barrier()  # every thread's load of this chunk's contribution is done before the overwrite
        tl.store(contrib_ptr + chunk * step + tile, state, mask=m)  # the state entering the chunk
        state = state * tl.exp(a_total) + contrib
    tl.debug_barrier()  # every thread's load of the old slot state comes before any thread overwrites it
    tl.store(state_ptrs, state.to(states_ptr.dtype.element_ty), mask=m)


@triton.jit
def _chunk_scan_kernel(
    x_ptr, b_ptr, c_ptr, dt_ptr, a_log_ptr, d_ptr, dt_bias_ptr, cu_ptr, starts_ptr, y_ptr, num_seqs, stride_x,
    stride_dt, stride_y, dt_min, HEADS: tl.constexpr, HEADS_PER_GROUP: tl.constexpr, P: tl.constexpr,
    N: tl.constexpr, CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
    PRECISION: tl.constexpr,
):
    chunk = tl.program_id(0)
    head = tl.program_id(1)
    group = head // HEADS_PER_GROUP
    bos, length = _chunk_of(cu_ptr, num_seqs, chunk, BLOCK_S, CHUNK)
    cols = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    m_p = cols < P
    n = tl.arange(0, BLOCK_N)
    m_n = n < N
    rows = tl.arange(0, CHUNK)
    m_t = rows < length
    tok = bos + rows
    dt, a_head = _chunk_dt(dt_ptr, stride_dt, a_log_ptr, dt_bias_ptr, head, tok, m_t, dt_min)
    a_cs = tl.cumsum(dt * a_head, axis=0)  # [L]
    start = tl.load(starts_ptr + chunk.to(tl.int64) * (HEADS * P * N) + head * P * N + cols[:, None] * N + n[None, :],
                    mask=m_p[:, None] & m_n[None, :], other=0.0)  # [BP, BN] state entering the chunk
    xv = tl.load(x_ptr + tok[:, None] * stride_x + head * P + cols[None, :], mask=m_t[:, None] & m_p[None, :],
                 other=0.0)  # [L, BP]
    bv = tl.load(b_ptr + tok[:, None] * stride_x + group * N + n[None, :], mask=m_t[:, None] & m_n[None, :],
                 other=0.0)  # [L, BN]
    cv = tl.load(c_ptr + tok[:, None] * stride_x + group * N + n[None, :], mask=m_t[:, None] & m_n[None, :],
                 other=0.0)
    cb = tl.dot(cv, tl.trans(bv), input_precision=PRECISION)  # [L, L]
    causal = rows[:, None] >= rows[None, :]
    weights = cb * tl.where(causal, tl.exp(a_cs[:, None] - a_cs[None, :]), 0.0) * dt[None, :]
    y = tl.dot(weights.to(xv.dtype), xv, input_precision=PRECISION)  # [L, BP] intra-chunk
    y_off = tl.dot(cv, tl.trans(start.to(cv.dtype)), input_precision=PRECISION)  # [L, BP]
    y += y_off * tl.exp(a_cs)[:, None]
    y += tl.load(d_ptr + head).to(tl.float32) * xv.to(tl.float32)
    tl.store(y_ptr + tok[:, None] * stride_y + head * P + cols[None, :], y.to(y_ptr.dtype.element_ty),
             mask=m_t[:, None] & m_p[None, :])


def ssd_chunked_scan(x: torch.Tensor, B: torch.Tensor, C: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor,
                     D: torch.Tensor, dt_bias: torch.Tensor, dt_min: float, cu_seqlens: torch.Tensor,
                     ssm_states: torch.Tensor, state_slots: torch.Tensor, heads: int, head_dim: int, y: torch.Tensor,
                     cfg: dict) -> torch.Tensor:
    """``ssd_scan.ssd_chunk_scan``'s contract (operands checked there), into ``y``; ``cfg``: CHUNK,
    BLOCK_P, num_warps, num_stages of the two chunk passes, PASS_P and pass_warps of the hand-over."""
    num_tokens, num_seqs = x.shape[0], state_slots.shape[0]
    n_state = ssm_states.shape[-1]
    groups = B.shape[1] // n_state
    chunk = int(cfg["CHUNK"])
    max_chunks = cdiv(num_tokens, chunk) + num_seqs + 1  # >= Σ cdiv(len, CHUNK) + 2 over the sequences
    # scratch: each chunk's contribution, overwritten with the state entering it; its total log decay
    contrib = torch.empty(max_chunks, heads, head_dim, n_state, dtype=torch.float32, device=x.device)
    decay = torch.empty(max_chunks, heads, dtype=torch.float32, device=x.device)
    block_n = max(16, next_power_of_2(n_state))
    block_s = max(16, next_power_of_2(num_seqs))
    block_p = min(cfg["BLOCK_P"], max(16, next_power_of_2(head_dim)))
    shape = dict(HEADS=heads, P=head_dim, N=n_state, CHUNK=chunk, BLOCK_N=block_n, BLOCK_S=block_s)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    launch = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    grid = (max_chunks, heads, cdiv(head_dim, block_p))
    _chunk_state_kernel[grid](
        x, B, dt, A_log, dt_bias, cu_seqlens, contrib, decay, num_seqs, x.stride(0), dt.stride(0), float(dt_min),
        HEADS_PER_GROUP=heads // groups, BLOCK_P=block_p, PRECISION=precision, **shape, **launch,
    )
    pass_p = min(int(cfg["PASS_P"]), next_power_of_2(head_dim))
    _state_pass_kernel[(num_seqs, heads, cdiv(head_dim, pass_p))](
        ssm_states, state_slots, cu_seqlens, contrib, decay, num_seqs, ssm_states.stride(0), BLOCK_P=pass_p, **shape,
        num_warps=cfg["pass_warps"],
    )
    _chunk_scan_kernel[grid](
        x, B, C, dt, A_log, D, dt_bias, cu_seqlens, contrib, y, num_seqs, x.stride(0), dt.stride(0), y.stride(0),
        float(dt_min), HEADS_PER_GROUP=heads // groups, BLOCK_P=block_p, PRECISION=precision, **shape, **launch,
    )
    return y
