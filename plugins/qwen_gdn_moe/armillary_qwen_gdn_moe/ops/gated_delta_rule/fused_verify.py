"""One fused Gated DeltaNet launch per layer for a verify step: every sequence's K + 1 tokens in a row,
each position's state written to its own row (so any accepted prefix's state survives), in Triton.

The chained alternative, one ``fused_gdn_decode`` per position, launches K + 1 kernels per layer and
reads every state back from memory between them; here a program keeps its state tile in registers
across the positions. Programs are (sequence, value head, BV columns) as in the decode kernel's value
split: the delta rule is column-local, and what crosses programs — the key head's q/k conv windows
and, when V is split, the gated RMSNorm of each row — is settled by the same per-(sequence, key head)
ticket: the last arriver writes the shared windows and normalises the rows. Position i's conv reads
the window the step started from followed by the step's own tokens, so no window is stored before
every program has read it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from armillary.kernels.triton.device_buffers import device_buffer, ticket_buffer
from armillary.kernels.triton.host import cdiv, next_power_of_2
from armillary.kernels.triton.pdl import launch_options, pdl_prologue
from armillary_qwen_gdn_moe.ops.gated_delta_rule.fused_recurrent import _gates, decode_config, normalise_rows


@triton.jit
def _tap(base, window, ch, m_ch, stride_mixed, J: tl.constexpr, KW: tl.constexpr):
    """Element J of the step's conv sequence on channels ``ch``: the window's KW - 1 taps, then the step's tokens."""
    if J < KW - 1:
        x = tl.load(window + ch * (KW - 1) + J, mask=m_ch, other=0.0)
    else:
        x = tl.load(base + (J - (KW - 1)) * stride_mixed + ch, mask=m_ch, other=0.0)
    return x


@triton.jit
def _conv_at(base, window, weight, ch, m_ch, stride_mixed, stride_w, T: tl.constexpr, KW: tl.constexpr):
    """Depthwise conv + SiLU of position T on channels ``ch``: [len(ch)] fp32."""
    y = tl.zeros(ch.shape, tl.float32)
    for m in tl.static_range(KW):
        x = _tap(base, window, ch, m_ch, stride_mixed, T + m, KW)
        y += tl.load(weight + ch * stride_w + m, mask=m_ch, other=0.0).to(tl.float32) * x.to(tl.float32)
    return y * tl.sigmoid(y)


@triton.jit
def _store_window_at(base, window, window_out, ch, m_ch, stride_mixed, T: tl.constexpr, KW: tl.constexpr):
    """The window after position T (sequence elements T+1 .. T+KW-1) into ``window_out``; in place is safe
    (tap m is read from element T+1+m > m, and taps go in ascending order)."""
    for m in tl.static_range(KW - 1):
        x = _tap(base, window, ch, m_ch, stride_mixed, T + 1 + m, KW)
        tl.store(window_out + ch * (KW - 1) + m, x.to(window_out.dtype.element_ty), mask=m_ch)


@triton.jit
def _gdn_verify_kernel(
    mixed, conv_weight, conv_states, ssm_states, a_log, dt_bias, norm_weight, state_slots, spec_rows, out,
    tickets, rows, partials,
    stride_mixed, stride_w, stride_conv, stride_ssm, stride_out, eps, scale,
    NUM_K_HEADS: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr, KW: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr, NV_P2: tl.constexpr, BV_ROW: tl.constexpr,
    STEPS: tl.constexpr, PDL: tl.constexpr,
):
    """Program (sequence, value head, V block) over the sequence's STEPS positions."""
    pdl_prologue(PDL)
    i_b = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_v = tl.program_id(2)
    i_kh = i_hv // GROUP
    KEY_DIM: tl.constexpr = NUM_K_HEADS * K
    NUM_V_HEADS: tl.constexpr = NUM_K_HEADS * GROUP
    VALUE_DIM: tl.constexpr = NUM_V_HEADS * V
    CONV_DIM: tl.constexpr = 2 * KEY_DIM + VALUE_DIM
    slot = tl.load(state_slots + i_b).to(tl.int64)
    base = mixed + (i_b * STEPS).to(tl.int64) * stride_mixed  # position 0's [q | k | v | z | b | a]
    window = conv_states + slot * stride_conv

    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    offs = i_hv * K * V + o_k[:, None] * V + o_v[None, :]  # [BK, BV] inside one state row
    m_s = m_k[:, None] & m_v[None, :]
    s = tl.load(ssm_states + slot * stride_ssm + offs, mask=m_s, other=0.0)  # [BK, BV] the one long load
    w = tl.load(norm_weight + o_v, mask=m_v, other=0.0).to(tl.float32)
    ch_q = i_kh * K + o_k
    ch_v = 2 * KEY_DIM + i_hv * V + o_v

    for t in tl.static_range(STEPS):
        row = base + t * stride_mixed
        beta, decay = _gates(row, a_log, dt_bias, i_hv, CONV_DIM + VALUE_DIM, NUM_V_HEADS)
        z = tl.load(row + CONV_DIM + i_hv * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        q = _conv_at(base, window, conv_weight, ch_q, m_k, stride_mixed, stride_w, t, KW)
        k = _conv_at(base, window, conv_weight, KEY_DIM + ch_q, m_k, stride_mixed, stride_w, t, KW)
        v = _conv_at(base, window, conv_weight, ch_v, m_v, stride_mixed, stride_w, t, KW)
        q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * scale
        k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
        s = s * decay
        delta = beta * (v - tl.sum(s * k[:, None], 0))  # what the decayed state does not yet predict
        o = tl.sum(s * q[:, None], 0) + tl.sum(q * k, 0) * delta  # [BV] (s + k delta^T)^T q
        s += k[:, None] * delta[None, :]
        gated = o * w * z * tl.sigmoid(z)
        sum_sq = tl.sum(o * o, 0)
        token = i_b * STEPS + t
        if NV == 1:
            y = gated * tl.rsqrt(sum_sq / V + eps)
            tl.store(out + token.to(tl.int64) * stride_out + i_hv * V + o_v, y.to(out.dtype.element_ty), mask=m_v)
        else:
            head = token * NUM_V_HEADS + i_hv
            tl.store(rows + head * V + o_v, gated, mask=m_v)
            tl.store(partials + head * NV + i_v, sum_sq)
        if t < STEPS - 1:  # a draft position's state: its own row, never read this step
            dst = tl.load(spec_rows + i_b * (STEPS - 1) + t).to(tl.int64)
            tl.store(ssm_states + dst * stride_ssm + offs, s, mask=m_s)
            _store_window_at(base, window, conv_states + dst * stride_conv, ch_v, m_v, stride_mixed, t, KW)
    # every thread has read the old windows and made its scratch stores before the slot's rows change
    tl.debug_barrier()
    tl.store(ssm_states + slot * stride_ssm + offs, s, mask=m_s)
    _store_window_at(base, window, window, ch_v, m_v, stride_mixed, STEPS - 1, KW)
    last = True
    if GROUP * NV > 1:
        p_ticket = tickets + i_b * NUM_K_HEADS + i_kh
        last = tl.atomic_add(p_ticket, 1, sem="acq_rel") == GROUP * NV - 1
    if last:  # every program of the key head has read the old q/k windows and written its row parts
        if NV > 1:
            for t in tl.static_range(STEPS):
                token = i_b * STEPS + t
                normalise_rows(out + token.to(tl.int64) * stride_out, rows, partials, token, i_kh, eps, GROUP, V,
                               NUM_V_HEADS, NV, NV_P2, BV_ROW)
        for t in tl.static_range(STEPS):  # the draft rows first: they read the slot's old taps
            if t < STEPS - 1:
                dst_window = conv_states + tl.load(spec_rows + i_b * (STEPS - 1) + t).to(tl.int64) * stride_conv
            else:
                dst_window = window
            _store_window_at(base, window, dst_window, ch_q, m_k, stride_mixed, t, KW)
            _store_window_at(base, window, dst_window, KEY_DIM + ch_q, m_k, stride_mixed, t, KW)
        if GROUP * NV > 1:
            tl.store(tickets + i_b * NUM_K_HEADS + i_kh, 0)  # ready for the next launch (and graph replay)


def fused_gdn_verify(
    mixed: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_states: torch.Tensor,
    ssm_states: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    state_slots: torch.Tensor,
    spec_rows: torch.Tensor,
    num_k_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    config: dict | None = None,
) -> torch.Tensor:
    """The Gated DeltaNet mixer of a verify step, between in_proj and out_proj.

    mixed: [B·(D+1), conv_dim + value_dim + 2·HV] in_proj rows, sequence-major (each sequence's D+1
    positions in a row); spec_rows: [B, D] int, contiguous: the state rows positions 0..D-1 write
    (distinct from every ``state_slots`` row); position D writes ``state_slots`` [B]. Every other
    argument as ``fused_gdn_decode``. The same as D+1 chained ``fused_gdn_decode`` calls with
    ``out_slots`` (position i reading the row i-1 wrote). Returns [B·(D+1), HV·V] in mixed's dtype.
    """
    num_v_heads = A_log.shape[0]
    key_dim, value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
    conv_dim, kw = conv_weight.shape
    batch, drafts = spec_rows.shape
    steps = drafts + 1
    if num_v_heads % num_k_heads or conv_dim != 2 * key_dim + value_dim \
            or mixed.shape != (batch * steps, conv_dim + value_dim + 2 * num_v_heads):
        raise ValueError(
            f"fused_gdn_verify: mixed {tuple(mixed.shape)} conv_weight {tuple(conv_weight.shape)} spec_rows "
            f"{tuple(spec_rows.shape)} do not fit H={num_k_heads} HV={num_v_heads} K={head_k_dim} V={head_v_dim}"
        )
    if ssm_states.shape[1:] != (num_v_heads, head_k_dim, head_v_dim) or ssm_states.dtype != torch.float32:
        raise ValueError(f"fused_gdn_verify: ssm_states {tuple(ssm_states.shape)} {ssm_states.dtype} is not "
                         "[slots, HV, K, V] fp32")
    if mixed.stride(-1) != 1 or conv_weight.stride(-1) != 1:
        raise ValueError("fused_gdn_verify: mixed and conv_weight need a contiguous last dim")
    if conv_states.stride()[1:] != (kw - 1, 1) or ssm_states.stride()[1:] != (head_k_dim * head_v_dim, head_v_dim, 1):
        raise ValueError("fused_gdn_verify: conv_states and ssm_states must be contiguous per slot")
    if not spec_rows.is_contiguous() or (state_slots.numel() > 1 and state_slots.stride(0) != 1):
        raise ValueError("fused_gdn_verify: spec_rows must be contiguous and state_slots unit-stride")
    out = torch.empty(batch * steps, value_dim, dtype=mixed.dtype, device=mixed.device)
    if batch == 0:
        return out
    cfg = decode_config(batch, head_k_dim, head_v_dim, mixed.device, config)
    bk, bv_row = next_power_of_2(head_k_dim), next_power_of_2(head_v_dim)
    split_bv = int(cfg["split_bv"]) or bv_row  # the key-head walk's one program per key head: a whole row here
    if split_bv & (split_bv - 1):
        raise ValueError(f"fused_gdn_verify: split_bv {split_bv} is not a power of two")
    bv = min(split_bv, bv_row)
    nv = cdiv(head_v_dim, bv)
    tickets = ticket_buffer(mixed.device, batch * num_k_heads)
    scratch = device_buffer("gdn_verify_rows", mixed.device, batch * steps * num_v_heads * (head_v_dim + nv),
                            torch.float32, zeroed=False)
    rows, partials = scratch, scratch[batch * steps * value_dim:]  # [B·S, HV, V] then [B·S, HV, NV]
    _gdn_verify_kernel[(batch, num_v_heads, nv)](
        mixed, conv_weight, conv_states, ssm_states, A_log, dt_bias, norm_weight, state_slots, spec_rows, out,
        tickets, rows, partials,
        mixed.stride(0), conv_weight.stride(0), conv_states.stride(0), ssm_states.stride(0), out.stride(0),
        eps, head_k_dim**-0.5,
        NUM_K_HEADS=num_k_heads, GROUP=num_v_heads // num_k_heads, K=head_k_dim, V=head_v_dim, KW=kw,
        BK=bk, BV=bv, NV=nv, NV_P2=next_power_of_2(nv), BV_ROW=bv_row, STEPS=steps,
        num_warps=cfg["num_warps"], **launch_options(mixed.device),
    )
    return out
