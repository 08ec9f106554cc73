"""One fused Gated DeltaNet decode step per layer in Triton: conv update, gating, q/k L2 norm, delta
rule state update, output and gated RMSNorm, for one new token per state slot.

Two launch shapes of one kernel, picked per batch size from the tuning table (``split_bv``):

* ``split_bv = 0`` (key-head walk): a program owns one token and one key head together with the
  ``HV / H`` value heads it serves, so every conv channel it reads and rewrites belongs to no other
  program. It walks its value heads one [K, V] fp32 state tile at a time; a value head's whole row
  is in one program, so the gated RMSNorm needs no second pass. Few programs: (B, H).
* ``split_bv = BV`` (value split): a program owns one token, one value head and BV of its V
  columns, (B, HV, cdiv(V, BV)) programs in all, which is what keeps the memory system busy at
  batch 1. The delta rule is column-local (every column reads only its own [K] slice of the state),
  so only two things cross programs, both settled by a per-(token, key head) ticket counter: the
  key head's q/k conv windows, which every program recomputes from the old window and the last
  arriver rewrites; and the gated RMSNorm over the row, for which each program leaves its gated
  outputs and its partial sum of squares in fp32 scratch and the last arriver of the key head sums
  the partials in a fixed order (deterministic) and writes the normalised rows. Nobody waits on
  anybody (no co-residency assumption), and the last arriver puts the counter back to zero.

Both are one launch whose grid depends only on the batch size, with nothing read back, so the call
is CUDA-graph capturable. The tickets and scratch are core's per-device ``device_buffers``, shared
by every layer and kernel (calls on one device must be stream-ordered, as a model's layers are).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from armillary.kernels.triton.device_buffers import device_buffer, ticket_buffer
from armillary.kernels.triton.host import cdiv, next_power_of_2
from armillary.kernels.triton.pdl import launch_options, pdl_launch_dependents, pdl_wait, prefetch_rows_l2
from armillary.kernels.tuning import kernel_config

# split_bv: 0 walks each key head's value heads in one program; a power of two splits V in BV columns;
# preload (optional, value split only): the state tile loaded before the PDL wait
DECODE_DEFAULTS = {"num_warps": 4, "split_bv": 0}


@triton.jit
def _conv_window_step(row, window, weight, ch, m_ch, stride_w, KW: tl.constexpr, KW_P2: tl.constexpr):
    """Depthwise conv + SiLU of one new token on channels ``ch``.

    Returns (output [len(ch)] fp32, the shifted window [KW_P2, len(ch)] to store after a barrier).
    """
    tap = tl.arange(0, KW_P2)[:, None]
    x = tl.load(row + ch, mask=m_ch, other=0.0)
    y = tl.load(weight + ch * stride_w + (KW - 1), mask=m_ch, other=0.0).to(tl.float32) * x.to(tl.float32)
    shifted = tl.where(tap == KW - 2, x.to(window.dtype.element_ty)[None, :], 0.0)
    for m in tl.static_range(KW - 1):
        old_m = tl.load(window + ch * (KW - 1) + m, mask=m_ch, other=0.0)
        y += tl.load(weight + ch * stride_w + m, mask=m_ch, other=0.0).to(tl.float32) * old_m.to(tl.float32)
        shifted = tl.where(tap == m - 1, old_m[None, :], shifted)
    return y * tl.sigmoid(y), shifted


@triton.jit
def _conv_out(row, window, weight, ch, m_ch, stride_w, KW: tl.constexpr):
    """Depthwise conv + SiLU of one new token on channels ``ch``: [len(ch)] fp32.

    All one-dimensional in the layout of ``ch``, so no value moves between threads (a shared-memory
    round trip whose barrier would hold back every load after it); the new token comes last.
    """
    y = tl.zeros(ch.shape, tl.float32)
    for m in tl.static_range(KW - 1):
        old_m = tl.load(window + ch * (KW - 1) + m, mask=m_ch, other=0.0)
        y += tl.load(weight + ch * stride_w + m, mask=m_ch, other=0.0).to(tl.float32) * old_m.to(tl.float32)
    x = tl.load(row + ch, mask=m_ch, other=0.0)
    y += tl.load(weight + ch * stride_w + (KW - 1), mask=m_ch, other=0.0).to(tl.float32) * x.to(tl.float32)
    return y * tl.sigmoid(y)


@triton.jit
def _shift_window(row, window, window_out, ch, m_ch, KW: tl.constexpr):
    """Window taps of ``ch`` in ``window_out`` <- (old taps 1 .. KW-2 of ``window``, new token);
    rereads what this program loaded before (L1 hits). In place (the same row): only once no other
    program still needs the old window."""
    for m in tl.static_range(KW - 2):
        later = tl.load(window + ch * (KW - 1) + m + 1, mask=m_ch)
        tl.store(window_out + ch * (KW - 1) + m, later, mask=m_ch)
    x = tl.load(row + ch, mask=m_ch)
    tl.store(window_out + ch * (KW - 1) + (KW - 2), x.to(window_out.dtype.element_ty), mask=m_ch)


@triton.jit
def _store_window(window, ch, m_ch, shifted, KW: tl.constexpr, KW_P2: tl.constexpr):
    """Writes a shifted window [KW_P2, len(ch)] back to the channels' KW - 1 taps."""
    tap = tl.arange(0, KW_P2)[:, None]
    tl.store(window + ch[None, :] * (KW - 1) + tap, shifted, mask=m_ch[None, :] & (tap < KW - 1))


@triton.jit
def _gates(row, a_log, dt_bias, i_hv, GATE_OFFSET: tl.constexpr, NUM_V_HEADS: tl.constexpr):
    """(beta, decay) of value head ``i_hv``: sigmoid(b) and exp(-exp(A_log) · softplus(a + dt_bias))."""
    beta = tl.sigmoid(tl.load(row + GATE_OFFSET + i_hv).to(tl.float32))
    a_dt = tl.load(row + GATE_OFFSET + NUM_V_HEADS + i_hv).to(tl.float32) + tl.load(dt_bias + i_hv)
    softplus = tl.where(a_dt > 20.0, a_dt, tl.log(1.0 + tl.exp(a_dt)))
    return beta, tl.exp(-tl.exp(tl.load(a_log + i_hv)) * softplus)


@triton.jit
def normalise_rows(out, rows, partials, token, i_kh, eps, GROUP: tl.constexpr, V: tl.constexpr,
                   NUM_V_HEADS: tl.constexpr, NV: tl.constexpr, NV_P2: tl.constexpr, BV_ROW: tl.constexpr):
    """A key head's last arriver: its GROUP value heads' gated rows of ``token`` (rows: [tokens, HV, V]
    fp32) times 1 / rms from the partial sums of squares (partials: [tokens, HV, NV]) into ``out``, the
    token's output row."""
    o_p = tl.arange(0, NV_P2)
    o_r = tl.arange(0, BV_ROW)
    for j in tl.static_range(GROUP):
        head = token * NUM_V_HEADS + i_kh * GROUP + j
        # .cg: straight from L2, where the other programs' stores are
        part = tl.load(partials + head * NV + o_p, mask=o_p < NV, other=0.0, cache_modifier=".cg")
        rstd = tl.rsqrt(tl.sum(part, 0) / V + eps)  # fixed summation order: deterministic
        g = tl.load(rows + head * V + o_r, mask=o_r < V, other=0.0, cache_modifier=".cg")
        tl.store(out + (i_kh * GROUP + j) * V + o_r, (g * rstd).to(out.dtype.element_ty), mask=o_r < V)


@triton.jit
def _key_head_step(
    mixed, conv_weight, conv_states, ssm_states, a_log, dt_bias, norm_weight, state_slots, out_slots, out,
    stride_mixed, stride_w, stride_conv, stride_ssm, stride_out, eps, scale,
    NUM_K_HEADS: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    KW: tl.constexpr, KW_P2: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    """Program (token, key head): its GROUP value heads' [K, V] tiles one after another."""
    i_b = tl.program_id(0)
    i_kh = tl.program_id(1)
    KEY_DIM: tl.constexpr = NUM_K_HEADS * K
    NUM_V_HEADS: tl.constexpr = NUM_K_HEADS * GROUP
    VALUE_DIM: tl.constexpr = NUM_V_HEADS * V
    CONV_DIM: tl.constexpr = 2 * KEY_DIM + VALUE_DIM
    slot = tl.load(state_slots + i_b).to(tl.int64)
    slot_out = tl.load(out_slots + i_b).to(tl.int64)  # the state row written (== slot except when verifying drafts)
    row = mixed + i_b.to(tl.int64) * stride_mixed  # [q | k | v | z | b | a] of this token
    window = conv_states + slot * stride_conv
    window_out = conv_states + slot_out * stride_conv
    out += i_b.to(tl.int64) * stride_out

    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = tl.arange(0, BV)
    m_v = o_v < V
    q, q_win = _conv_window_step(row, window, conv_weight, i_kh * K + o_k, m_k, stride_w, KW, KW_P2)
    k, k_win = _conv_window_step(row, window, conv_weight, KEY_DIM + i_kh * K + o_k, m_k, stride_w, KW, KW_P2)
    q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * scale
    k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
    w = tl.load(norm_weight + o_v, mask=m_v, other=0.0).to(tl.float32)
    offs = o_k[:, None] * V + o_v[None, :]  # [BK, BV] inside one head's [K, V] state
    m_s = m_k[:, None] & m_v[None, :]

    for j in tl.static_range(GROUP):
        i_hv = i_kh * GROUP + j
        ch_v = 2 * KEY_DIM + i_hv * V + o_v
        v, v_win = _conv_window_step(row, window, conv_weight, ch_v, m_v, stride_w, KW, KW_P2)
        beta, decay = _gates(row, a_log, dt_bias, i_hv, CONV_DIM + VALUE_DIM, NUM_V_HEADS)

        p_s = ssm_states + slot * stride_ssm + i_hv * K * V
        p_s_out = ssm_states + slot_out * stride_ssm + i_hv * K * V
        s = tl.load(p_s + offs, mask=m_s, other=0.0) * decay  # [BK, BV]
        delta = beta * (v - tl.sum(s * k[:, None], 0))  # what the decayed state does not yet predict
        s += k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], 0)  # [BV]

        # gated RMSNorm over the head: o_hat · w · silu(z)
        rstd = tl.rsqrt(tl.sum(tl.where(m_v, o * o, 0.0), 0) / V + eps)
        z = tl.load(row + CONV_DIM + i_hv * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        y = o * rstd * w * z * tl.sigmoid(z)
        tl.debug_barrier()  # this head's (and, first time, q/k's) old windows and state are all read
        tl.store(p_s_out + offs, s, mask=m_s)
        _store_window(window_out, ch_v, m_v, v_win, KW, KW_P2)
        tl.store(out + i_hv * V + o_v, y.to(out.dtype.element_ty), mask=m_v)
    _store_window(window_out, i_kh * K + o_k, m_k, q_win, KW, KW_P2)
    _store_window(window_out, KEY_DIM + i_kh * K + o_k, m_k, k_win, KW, KW_P2)


@triton.jit
def _value_split_step(
    mixed, conv_weight, conv_states, ssm_states, a_log, dt_bias, norm_weight, state_slots, out_slots, out,
    tickets, rows, partials,
    stride_mixed, stride_w, stride_conv, stride_ssm, stride_out, eps, scale,
    NUM_K_HEADS: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    KW: tl.constexpr, KW_P2: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    NV: tl.constexpr, NV_P2: tl.constexpr, BV_ROW: tl.constexpr, PDL: tl.constexpr, PRELOAD: tl.constexpr,
):
    """Program (token, value head, V block): one [K, BV] tile; tickets settle the shared q/k windows
    and, when NV > 1, the row's RMSNorm (rows: [B, HV, V] fp32 gated outputs, partials: [B, HV, NV]).
    PRELOAD: the state tile is read before the PDL wait (an earlier step wrote it; the slots are copied in
    before the step's first kernel), so its load overlaps the previous kernel's tail."""
    i_b = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_v = tl.program_id(2)
    i_kh = i_hv // GROUP
    KEY_DIM: tl.constexpr = NUM_K_HEADS * K
    NUM_V_HEADS: tl.constexpr = NUM_K_HEADS * GROUP
    VALUE_DIM: tl.constexpr = NUM_V_HEADS * V
    CONV_DIM: tl.constexpr = 2 * KEY_DIM + VALUE_DIM
    slot = tl.load(state_slots + i_b).to(tl.int64)
    slot_out = tl.load(out_slots + i_b).to(tl.int64)
    row = mixed + i_b.to(tl.int64) * stride_mixed  # [q | k | v | z | b | a] of this token
    window = conv_states + slot * stride_conv
    window_out = conv_states + slot_out * stride_conv
    out += i_b.to(tl.int64) * stride_out

    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    p_s = ssm_states + slot * stride_ssm + i_hv * K * V + o_k[:, None] * V + o_v[None, :]
    p_s_out = p_s + (slot_out - slot) * stride_ssm
    m_s = m_k[:, None] & m_v[None, :]
    if PRELOAD:
        s = tl.load(p_s, mask=m_s, other=0.0)  # [BK, BV] the one long load, before the previous kernel ends
    pdl_wait(PDL)
    if not PRELOAD:
        s = tl.load(p_s, mask=m_s, other=0.0)  # [BK, BV] issued first: the one long load

    # every other load before the first layout change or reduction: no load may cross their barriers
    beta, decay = _gates(row, a_log, dt_bias, i_hv, CONV_DIM + VALUE_DIM, NUM_V_HEADS)
    z = tl.load(row + CONV_DIM + i_hv * V + o_v, mask=m_v, other=0.0).to(tl.float32)
    w = tl.load(norm_weight + o_v, mask=m_v, other=0.0).to(tl.float32)
    ch_q = i_kh * K + o_k
    q = _conv_out(row, window, conv_weight, ch_q, m_k, stride_w, KW)
    k = _conv_out(row, window, conv_weight, KEY_DIM + ch_q, m_k, stride_w, KW)
    ch_v = 2 * KEY_DIM + i_hv * V + o_v
    v = _conv_out(row, window, conv_weight, ch_v, m_v, stride_w, KW)

    q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * scale
    k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
    s = s * decay
    delta = beta * (v - tl.sum(s * k[:, None], 0))  # what the decayed state does not yet predict
    # (s + k delta^T)^T q without waiting for the update: both reductions read the decayed state
    o = tl.sum(s * q[:, None], 0) + tl.sum(q * k, 0) * delta  # [BV]
    s += k[:, None] * delta[None, :]
    gated = o * w * z * tl.sigmoid(z)  # [BV] the output before the row's 1 / rms
    sum_sq = tl.sum(o * o, 0)  # masked columns are 0

    if NV == 1:  # the whole row is here
        tl.store(out + i_hv * V + o_v, (gated * tl.rsqrt(sum_sq / V + eps)).to(out.dtype.element_ty), mask=m_v)
    else:
        head = i_b * NUM_V_HEADS + i_hv
        tl.store(rows + head * V + o_v, gated, mask=m_v)
        tl.store(partials + head * NV + i_v, sum_sq)
    # every thread has read the old windows and state, and made its scratch stores before the release below
    tl.debug_barrier()
    if GROUP * NV == 1:  # the key head's windows are ours alone too
        tl.store(p_s_out, s, mask=m_s)
        _shift_window(row, window, window_out, ch_v, m_v, KW)
        _shift_window(row, window, window_out, ch_q, m_k, KW)
        _shift_window(row, window, window_out, KEY_DIM + ch_q, m_k, KW)
    else:
        p_ticket = tickets + i_b * NUM_K_HEADS + i_kh
        ticket = tl.atomic_add(p_ticket, 1, sem="acq_rel")
        # the state and v window (ours alone) after the ticket: the release need not wait for them
        tl.store(p_s_out, s, mask=m_s)
        _shift_window(row, window, window_out, ch_v, m_v, KW)
        if ticket == GROUP * NV - 1:  # last of the key head: every old q/k window read, every row part written
            if NV > 1:
                normalise_rows(out, rows, partials, i_b, i_kh, eps, GROUP, V, NUM_V_HEADS, NV, NV_P2, BV_ROW)
            _shift_window(row, window, window_out, ch_q, m_k, KW)
            _shift_window(row, window, window_out, KEY_DIM + ch_q, m_k, KW)
            tl.store(p_ticket, 0)  # ready for the next launch (and graph replay)


@triton.jit
def _gdn_decode_kernel(
    mixed, conv_weight, conv_states, ssm_states, a_log, dt_bias, norm_weight, state_slots, out_slots, out,
    tickets, rows, partials,
    stride_mixed, stride_w, stride_conv, stride_ssm, stride_out, eps, scale,
    NUM_K_HEADS: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    KW: tl.constexpr, KW_P2: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    SPLIT: tl.constexpr, NV: tl.constexpr, NV_P2: tl.constexpr, BV_ROW: tl.constexpr, PDL: tl.constexpr,
    PREFETCH: tl.constexpr, PRELOAD: tl.constexpr,
):
    pdl_launch_dependents(PDL)
    if PREFETCH:  # the state rows were written by an earlier step and the slots copied in before it: ask L2 now
        slot = tl.load(state_slots + tl.program_id(0)).to(tl.int64)
        o_k = tl.minimum(tl.arange(0, BK), K - 1)
        if SPLIT:
            head = ssm_states + slot * stride_ssm + tl.program_id(1) * K * V
            v_lo = tl.program_id(2) * BV
            prefetch_rows_l2(head, o_k, V, v_lo, tl.minimum(v_lo + BV, V), BV)
        else:
            for j in tl.static_range(GROUP):
                head = ssm_states + slot * stride_ssm + (tl.program_id(1) * GROUP + j) * K * V
                prefetch_rows_l2(head, o_k, V, 0, V, BV)
    if SPLIT:  # waits for the previous kernel itself (after its state load when PRELOAD)
        _value_split_step(
            mixed, conv_weight, conv_states, ssm_states, a_log, dt_bias, norm_weight, state_slots, out_slots, out,
            tickets, rows, partials, stride_mixed, stride_w, stride_conv, stride_ssm, stride_out, eps, scale,
            NUM_K_HEADS, GROUP, K, V, KW, KW_P2, BK, BV, NV, NV_P2, BV_ROW, PDL, PRELOAD,
        )
    else:
        pdl_wait(PDL)
        _key_head_step(
            mixed, conv_weight, conv_states, ssm_states, a_log, dt_bias, norm_weight, state_slots, out_slots, out,
            stride_mixed, stride_w, stride_conv, stride_ssm, stride_out, eps, scale,
            NUM_K_HEADS, GROUP, K, V, KW, KW_P2, BK, BV,
        )


def decode_config(batch: int, head_k_dim: int, head_v_dim: int, device: torch.device,
                  config: dict | None = None) -> dict:
    """The launch config for ``batch`` tokens: defaults, then the tuning table's entry (its
    ``"by_batch"`` map {"max batch": overrides} applies the smallest key >= batch), then ``config``."""
    bk, bv = next_power_of_2(head_k_dim), next_power_of_2(head_v_dim)
    cfg = kernel_config("armillary_qwen_gdn_moe", "gdn_decode", f"k{bk}_v{bv}", DECODE_DEFAULTS, device)
    by_batch = cfg.pop("by_batch", None) or {}
    fits = [int(limit) for limit in by_batch if int(limit) >= batch]
    if fits:
        cfg.update(by_batch[str(min(fits))])
    return {**cfg, **(config or {})}


def fused_gdn_decode(
    mixed: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_states: torch.Tensor,
    ssm_states: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    state_slots: torch.Tensor,
    num_k_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    out: torch.Tensor | None = None,
    config: dict | None = None,
    out_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Gated DeltaNet mixer of one decode token per sequence, between in_proj and out_proj.

    mixed: [B, conv_dim + value_dim + 2·HV] in_proj output rows [q | k | v | z | b | a] (model
    dtype; conv_dim = 2·H·K + HV·V); conv_weight: [conv_dim, kernel]; conv_states: [slots,
    conv_dim, kernel-1]; ssm_states: [slots, HV, K, V] fp32; A_log, dt_bias: [HV] fp32;
    norm_weight: [V]; state_slots: [B] int (distinct, except padding rows whose results nobody
    reads). conv_states and ssm_states of those slots are updated in place. q, k are
    L2-normalised (eps 1e-6 inside the root), q scaled by K^-0.5. ``out``: optional [B, HV·V]
    destination; ``config`` ({"num_warps", "split_bv"}) overrides the tuning table. ``out_slots``:
    [B] rows to write the new states to instead of ``state_slots`` (verifying drafts: each
    position's state kept apart; must not be another token's ``state_slots`` row).
    Returns [B, HV·V] in mixed's dtype, ready for out_proj.
    """
    num_v_heads = A_log.shape[0]
    key_dim, value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
    conv_dim, kw = conv_weight.shape
    if num_v_heads % num_k_heads or conv_dim != 2 * key_dim + value_dim \
            or mixed.shape[1] != conv_dim + value_dim + 2 * num_v_heads:
        raise ValueError(
            f"fused_gdn_decode: mixed {tuple(mixed.shape)} conv_weight {tuple(conv_weight.shape)} do not fit "
            f"H={num_k_heads} HV={num_v_heads} K={head_k_dim} V={head_v_dim}"
        )
    if ssm_states.shape[1:] != (num_v_heads, head_k_dim, head_v_dim) or ssm_states.dtype != torch.float32:
        raise ValueError(
            f"fused_gdn_decode: ssm_states {tuple(ssm_states.shape)} {ssm_states.dtype} is not [slots, HV, K, V] fp32"
        )
    for t in (mixed, conv_weight):
        if t.stride(-1) != 1:
            raise ValueError("fused_gdn_decode: mixed and conv_weight need a contiguous last dim")
    if conv_states.stride()[1:] != (kw - 1, 1) or ssm_states.stride()[1:] != (head_k_dim * head_v_dim, head_v_dim, 1):
        raise ValueError("fused_gdn_decode: conv_states and ssm_states must be contiguous per slot")
    if any(t is not None and t.numel() > 1 and t.stride(0) != 1 for t in (state_slots, out_slots)):
        raise ValueError("fused_gdn_decode: state_slots and out_slots must be unit-stride")
    batch = mixed.shape[0]
    if out is None:
        out = torch.empty(batch, value_dim, dtype=mixed.dtype, device=mixed.device)
    if batch == 0:
        return out
    cfg = decode_config(batch, head_k_dim, head_v_dim, mixed.device, config)
    bk, bv_row = next_power_of_2(head_k_dim), next_power_of_2(head_v_dim)
    split_bv = int(cfg["split_bv"])
    if split_bv:
        if split_bv & (split_bv - 1):
            raise ValueError(f"fused_gdn_decode: split_bv {split_bv} is not a power of two")
        bv = min(split_bv, bv_row)
        nv = cdiv(head_v_dim, bv)
        grid = (batch, num_v_heads, nv)
        tickets = ticket_buffer(mixed.device, batch * num_k_heads)
        scratch = device_buffer("gdn_decode_rows", mixed.device, batch * num_v_heads * (head_v_dim + nv), torch.float32,
                                zeroed=False)
        rows, partials = scratch, scratch[batch * value_dim:]  # [B, HV, V] then [B, HV, NV]
    else:
        bv, nv = bv_row, 1
        grid = (batch, num_k_heads)
        tickets, rows, partials = state_slots, ssm_states, ssm_states  # not touched
    _gdn_decode_kernel[grid](
        mixed, conv_weight, conv_states, ssm_states, A_log, dt_bias, norm_weight, state_slots,
        state_slots if out_slots is None else out_slots, out,
        tickets, rows, partials,
        mixed.stride(0), conv_weight.stride(0), conv_states.stride(0), ssm_states.stride(0), out.stride(0),
        eps, head_k_dim**-0.5,
        NUM_K_HEADS=num_k_heads, GROUP=num_v_heads // num_k_heads, K=head_k_dim, V=head_v_dim,
        KW=kw, KW_P2=next_power_of_2(kw), BK=bk, BV=bv, SPLIT=bool(split_bv), NV=nv,
        NV_P2=next_power_of_2(nv), BV_ROW=bv_row, PRELOAD=bool(split_bv and cfg.get("preload", False)),
        num_warps=cfg["num_warps"],
        **launch_options(mixed.device, prefetch="state"),
    )
    return out
