"""One fused Gated DeltaNet decode step per layer in Triton: conv update, gating, q/k L2 norm, delta
rule state update, output and gated RMSNorm, for one new token per state slot.

A program owns one token and one key head together with the ``HV / H`` value heads it serves, so
the conv channels it reads and rewrites (that key head's q and k, those value heads' v) belong to
no other program: the whole step is one launch with no cross-program ordering. It walks its value
heads one [K, V] fp32 state tile at a time (128 × 128 on Qwen3-Next / Qwen3.6); a value head's
whole row is in one program, so the gated RMSNorm needs no second pass. Shapes depend only on the
batch size and nothing is read back, so the call is CUDA-graph capturable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from armillary.kernels.tuning import kernel_config

DECODE_DEFAULTS = {"num_warps": 4}


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
def _gdn_decode_kernel(
    mixed, conv_weight, conv_states, ssm_states, a_log, dt_bias, norm_weight, state_slots, out,
    stride_mixed, stride_w, stride_conv, stride_ssm, stride_out, eps, scale,
    NUM_K_HEADS: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    KW: tl.constexpr, KW_P2: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    i_b = tl.program_id(0)
    i_kh = tl.program_id(1)
    KEY_DIM: tl.constexpr = NUM_K_HEADS * K
    NUM_V_HEADS: tl.constexpr = NUM_K_HEADS * GROUP
    VALUE_DIM: tl.constexpr = NUM_V_HEADS * V
    CONV_DIM: tl.constexpr = 2 * KEY_DIM + VALUE_DIM
    slot = tl.load(state_slots + i_b).to(tl.int64)
    row = mixed + i_b.to(tl.int64) * stride_mixed  # [q | k | v | z | b | a] of this token
    window = conv_states + slot * stride_conv
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
    tap = tl.arange(0, KW_P2)[:, None]
    m_tap = tap < KW - 1
    offs = o_k[:, None] * V + o_v[None, :]  # [BK, BV] inside one head's [K, V] state
    m_s = m_k[:, None] & m_v[None, :]

    for j in tl.static_range(GROUP):
        i_hv = i_kh * GROUP + j
        ch_v = 2 * KEY_DIM + i_hv * V + o_v
        v, v_win = _conv_window_step(row, window, conv_weight, ch_v, m_v, stride_w, KW, KW_P2)
        beta = tl.sigmoid(tl.load(row + CONV_DIM + VALUE_DIM + i_hv).to(tl.float32))
        a_dt = tl.load(row + CONV_DIM + VALUE_DIM + NUM_V_HEADS + i_hv).to(tl.float32) + tl.load(dt_bias + i_hv)
        softplus = tl.where(a_dt > 20.0, a_dt, tl.log(1.0 + tl.exp(a_dt)))
        decay = tl.exp(-tl.exp(tl.load(a_log + i_hv)) * softplus)

        p_s = ssm_states + slot * stride_ssm + i_hv * K * V
        s = tl.load(p_s + offs, mask=m_s, other=0.0) * decay  # [BK, BV]
        delta = beta * (v - tl.sum(s * k[:, None], 0))  # what the decayed state does not yet predict
        s += k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], 0)  # [BV]

        # gated RMSNorm over the head: o_hat · w · silu(z)
        rstd = tl.rsqrt(tl.sum(tl.where(m_v, o * o, 0.0), 0) / V + eps)
        z = tl.load(row + CONV_DIM + i_hv * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        y = o * rstd * w * z * tl.sigmoid(z)
        tl.debug_barrier()  # this head's (and, first time, q/k's) old windows and state are all read
        tl.store(p_s + offs, s, mask=m_s)
        tl.store(window + ch_v[None, :] * (KW - 1) + tap, v_win, mask=m_v[None, :] & m_tap)
        tl.store(out + i_hv * V + o_v, y.to(out.dtype.element_ty), mask=m_v)
    tl.store(window + (i_kh * K + o_k)[None, :] * (KW - 1) + tap, q_win, mask=m_k[None, :] & m_tap)
    tl.store(window + (KEY_DIM + i_kh * K + o_k)[None, :] * (KW - 1) + tap, k_win, mask=m_k[None, :] & m_tap)


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
) -> torch.Tensor:
    """The Gated DeltaNet mixer of one decode token per sequence, between in_proj and out_proj.

    mixed: [B, conv_dim + value_dim + 2·HV] in_proj output rows [q | k | v | z | b | a] (model
    dtype; conv_dim = 2·H·K + HV·V); conv_weight: [conv_dim, kernel]; conv_states: [slots,
    conv_dim, kernel-1]; ssm_states: [slots, HV, K, V] fp32; A_log, dt_bias: [HV] fp32;
    norm_weight: [V]; state_slots: [B] int (distinct). conv_states and ssm_states of those slots
    are updated in place. q, k are L2-normalised (eps 1e-6 inside the root), q scaled by K^-0.5.
    ``out``: optional [B, HV·V] destination; ``config`` overrides the tuning table.
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
    batch = mixed.shape[0]
    if out is None:
        out = torch.empty(batch, value_dim, dtype=mixed.dtype, device=mixed.device)
    if batch == 0:
        return out
    group = num_v_heads // num_k_heads
    bk, bv = triton.next_power_of_2(head_k_dim), triton.next_power_of_2(head_v_dim)
    cfg = {**kernel_config("armillary_qwen_gdn_moe", "gdn_decode", f"k{bk}_v{bv}", DECODE_DEFAULTS, mixed.device),
           **(config or {})}
    _gdn_decode_kernel[(batch, num_k_heads)](
        mixed, conv_weight, conv_states, ssm_states, A_log, dt_bias, norm_weight, state_slots, out,
        mixed.stride(0), conv_weight.stride(0), conv_states.stride(0), ssm_states.stride(0), out.stride(0),
        eps, head_k_dim**-0.5,
        NUM_K_HEADS=num_k_heads, GROUP=group, K=head_k_dim, V=head_v_dim,
        KW=kw, KW_P2=triton.next_power_of_2(kw), BK=bk, BV=bv, num_warps=cfg["num_warps"],
    )
    return out
