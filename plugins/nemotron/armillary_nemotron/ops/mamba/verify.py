"""One fused Mamba-2 launch per layer for a speculative verify step: K + 1 positions per sequence, the conv window and SSM state after each kept in its own row.

``mamba_verify_step`` does what K + 1 chained ``mamba_decode_step`` launches do (position i
reading the rows position i - 1 wrote; each launch preceded by copying those rows into its
destination) in one launch with no row copies: a program loads its slot's state tile once, keeps
it in fp32 registers across the positions (rounded to the states' dtype after each, as a chained
step would read it back), and stores it after position i < K into ``spec_rows[:, i]`` and after
position K into the slot. Each position's conv reads the sequence "slot window taps, then the
step's inputs", so the slot's own window is written only at the end, after every read of it.

Programs are (sequence, head, BLOCK_P state rows), the decode kernel's row split (``split_p`` of
its tuning table, which a "mamba_verify" entry may override; 0 gives one program per head). What
crosses programs is settled as there by the per-(sequence, group) ticket: the group's B / C windows
(every program recomputes them; the last arriver writes them into every destination row) and the
group's gated RMSNorm of every position (each program leaves its fp32 gated rows and sums of
squares in scratch; the last arriver normalises, in a fixed order: deterministic). One launch
whose grid depends only on the batch size, nothing read back: CUDA-graph capturable. References:
``chained_decode_verify`` (below) and ``naive.verify_steps_ref`` with core's ``gated_rms_norm``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from armillary.kernels.triton.device_buffers import device_buffer, ticket_buffer
from armillary.kernels.triton.host import cdiv, next_power_of_2
from armillary.kernels.triton.pdl import launch_options, pdl_prologue
from armillary.kernels.tuning import kernel_config
from armillary_nemotron.ops.mamba.decode import TUNING_PACKAGE, _window_write, decode_config, mamba_decode_step


@triton.jit
def _tap(base, window, ch, mask, stride_xbc, J: tl.constexpr, KW: tl.constexpr):
    """Element J of the step's conv sequence on channels ``ch`` as a window holds it (the window's
    dtype): the slot's KW - 1 taps, then the step's inputs."""
    if J < KW - 1:
        v = tl.load(window + ch * (KW - 1) + J, mask=mask, other=0.0)
    else:
        v = tl.load(base + (J - (KW - 1)) * stride_xbc + ch, mask=mask, other=0.0).to(window.dtype.element_ty)
    return v


@triton.jit
def _conv_at(base, window, w_ptr, bias_ptr, ch, mask, stride_xbc, stride_w, T: tl.constexpr, KW: tl.constexpr,
             HAS_BIAS: tl.constexpr):
    """silu(conv) of position T on channels ``ch`` [C] fp32, summed in the decode kernel's order
    (newest tap, bias, then the older taps) from the values a chained step would read."""
    x = tl.load(base + T * stride_xbc + ch, mask=mask, other=0.0)  # the newest tap: the input as the decode reads it
    acc = tl.load(w_ptr + ch * stride_w + (KW - 1), mask=mask, other=0.0).to(tl.float32) * x.to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + ch, mask=mask, other=0.0).to(tl.float32)
    for m in tl.static_range(KW - 1):
        old = _tap(base, window, ch, mask, stride_xbc, T + m, KW)
        acc += tl.load(w_ptr + ch * stride_w + m, mask=mask, other=0.0).to(tl.float32) * old.to(tl.float32)
    return acc * tl.sigmoid(acc)


@triton.jit
def _window_after(base, window, ch, mask, stride_xbc, T: tl.constexpr, KW: tl.constexpr, KW_P2: tl.constexpr,
                  BLOCK_C: tl.constexpr):
    """Loads only: the window after position T on channels ``ch`` (sequence elements T+1 .. T+KW-1),
    [BLOCK_C, KW_P2] in the window's dtype, for ``decode._window_write``."""
    col = tl.arange(0, KW_P2)
    new = tl.zeros([BLOCK_C, KW_P2], dtype=window.dtype.element_ty)
    for m in tl.static_range(KW - 1):
        v = _tap(base, window, ch, mask, stride_xbc, T + 1 + m, KW)  # [C]
        new = tl.where((col == m)[None, :], v[:, None], new)
    return new


@triton.jit
def _mamba_verify_kernel(
    xbc_ptr, z_ptr, dt_ptr, w_ptr, bias_ptr, conv_ptr, a_log_ptr, d_ptr, dt_bias_ptr, norm_w_ptr, states_ptr, slots_ptr,
    spec_ptr, out_ptr, tickets_ptr, rows_ptr, partials_ptr, stride_xbc, stride_z, stride_dt, stride_w, stride_conv,
    stride_state, stride_out, stride_spec_b, stride_spec_k, dt_min, eps,
    GROUPS: tl.constexpr, HPG: tl.constexpr, P: tl.constexpr, N: tl.constexpr, KW: tl.constexpr,
    KW_P2: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, NP: tl.constexpr,
    PARTS_P2: tl.constexpr, BLOCK_G: tl.constexpr, STEPS: tl.constexpr, PDL: tl.constexpr,
):
    """Program (sequence, head, block of BLOCK_P state rows) over the sequence's STEPS positions; rows_ptr
    [B·STEPS, H·P] fp32 gated rows and partials_ptr [B·STEPS, H, NP] sums of squares when the group spans
    programs."""
    pdl_prologue(PDL)
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    block = tl.program_id(2)
    group = head // HPG
    D_INNER: tl.constexpr = GROUPS * HPG * P
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    base = xbc_ptr + seq * STEPS * stride_xbc  # position 0's x ‖ B ‖ C row
    window = conv_ptr + slot * stride_conv
    head_state = head * P * N

    ps = block * BLOCK_P + tl.arange(0, BLOCK_P)
    ns = tl.arange(0, BLOCK_N)
    m_p = ps < P
    m_n = ns < N
    m_state = m_p[:, None] & m_n[None, :]
    tile = ps[:, None] * N + ns[None, :]  # [BP, BN] inside the head's [P, N] state
    s = tl.load(states_ptr + slot * stride_state + head_state + tile, mask=m_state, other=0.0)  # the one long load
    x_ch = head * P + ps
    b_ch = D_INNER + group * N + ns
    c_ch = b_ch + GROUPS * N
    dt_b = tl.load(dt_bias_ptr + head).to(tl.float32)
    a = tl.exp(tl.load(a_log_ptr + head).to(tl.float32))  # A = -exp(A_log)
    d_skip = tl.load(d_ptr + head).to(tl.float32)
    if HPG * NP == 1:
        norm_w = tl.load(norm_w_ptr + x_ch, mask=m_p, other=0.0).to(tl.float32)

    state = s.to(tl.float32)
    for t in tl.static_range(STEPS):
        token = seq * STEPS + t
        x = _conv_at(base, window, w_ptr, bias_ptr, x_ch, m_p, stride_xbc, stride_w, t, KW, HAS_BIAS)  # [BP]
        bv = _conv_at(base, window, w_ptr, bias_ptr, b_ch, m_n, stride_xbc, stride_w, t, KW, HAS_BIAS)  # [BN]
        cv = _conv_at(base, window, w_ptr, bias_ptr, c_ch, m_n, stride_xbc, stride_w, t, KW, HAS_BIAS)
        z = tl.load(z_ptr + token * stride_z + x_ch, mask=m_p, other=0.0).to(tl.float32)
        raw = tl.load(dt_ptr + token * stride_dt + head).to(tl.float32) + dt_b
        dt = tl.maximum(tl.where(raw > 20.0, raw, tl.log(1.0 + tl.exp(raw))), dt_min)
        decay = tl.exp(-dt * a)
        state = state * decay + (dt * x)[:, None] * bv[None, :]  # [BP, BN]
        state = state.to(states_ptr.dtype.element_ty).to(tl.float32)  # what the next chained step would read
        y = tl.sum(state * cv[None, :], axis=1) + d_skip * x  # [BP]
        gated = tl.where(m_p, y * z * tl.sigmoid(z), 0.0)
        sum_sq = tl.sum(gated * gated, axis=0)
        if HPG * NP == 1:  # the program holds its whole group: nothing crosses programs
            inv = tl.rsqrt(sum_sq / (HPG * P) + eps)
            tl.store(out_ptr + token * stride_out + x_ch, (gated * inv * norm_w).to(out_ptr.dtype.element_ty), mask=m_p)
        else:
            tl.store(rows_ptr + token * D_INNER + x_ch, gated, mask=m_p)
            tl.store(partials_ptr + (token * GROUPS * HPG + head) * NP + block, sum_sq)
        if t < STEPS - 1:  # a draft position's state: its own row, never read this step
            dst = tl.load(spec_ptr + seq * stride_spec_b + t * stride_spec_k).to(tl.int64)
            tl.store(states_ptr + dst * stride_state + head_state + tile, state.to(states_ptr.dtype.element_ty),
                     mask=m_state)
            dst_window = conv_ptr + dst * stride_conv
            _window_write(dst_window, x_ch, m_p, _window_after(base, window, x_ch, m_p, stride_xbc, t, KW, KW_P2,
                                                               BLOCK_P), KW, KW_P2)
            if HPG * NP == 1:
                _window_write(dst_window, b_ch, m_n, _window_after(base, window, b_ch, m_n, stride_xbc, t, KW, KW_P2,
                                                                   BLOCK_N), KW, KW_P2)
                _window_write(dst_window, c_ch, m_n, _window_after(base, window, c_ch, m_n, stride_xbc, t, KW, KW_P2,
                                                                   BLOCK_N), KW, KW_P2)

    # the slot's windows after the last position: loaded now (registers free of the loop), stored after the barrier
    x_last = _window_after(base, window, x_ch, m_p, stride_xbc, STEPS - 1, KW, KW_P2, BLOCK_P)
    if HPG * NP == 1:
        b_last = _window_after(base, window, b_ch, m_n, stride_xbc, STEPS - 1, KW, KW_P2, BLOCK_N)
        c_last = _window_after(base, window, c_ch, m_n, stride_xbc, STEPS - 1, KW, KW_P2, BLOCK_N)
    # every thread's reads of the slot's old tile and windows (and its scratch stores) are done
    tl.debug_barrier()
    tl.store(states_ptr + slot * stride_state + head_state + tile, state.to(states_ptr.dtype.element_ty), mask=m_state)
    _window_write(window, x_ch, m_p, x_last, KW, KW_P2)
    if HPG * NP == 1:
        _window_write(window, b_ch, m_n, b_last, KW, KW_P2)
        _window_write(window, c_ch, m_n, c_last, KW, KW_P2)
    else:
        ticket_at = tickets_ptr + seq * GROUPS + group
        ticket = tl.atomic_add(ticket_at, 1, sem="acq_rel")
        if ticket == HPG * NP - 1:  # the last of the group: every old B / C window read, every partial written
            o = tl.arange(0, PARTS_P2)
            g_off = tl.arange(0, BLOCK_G)
            m_g = g_off < HPG * P
            g_ch = group * HPG * P + g_off
            w = tl.load(norm_w_ptr + g_ch, mask=m_g, other=0.0).to(tl.float32)
            for t in tl.static_range(STEPS):
                token = seq * STEPS + t
                # .cg: straight from L2, where the other programs' stores are; a fixed order: deterministic
                parts = tl.load(partials_ptr + (token * GROUPS + group) * HPG * NP + o, mask=o < HPG * NP, other=0.0,
                                cache_modifier=".cg")
                inv = tl.rsqrt(tl.sum(parts, axis=0) / (HPG * P) + eps)
                g = tl.load(rows_ptr + token * D_INNER + g_ch, mask=m_g, other=0.0, cache_modifier=".cg")
                tl.store(out_ptr + token * stride_out + g_ch, (g * inv * w).to(out_ptr.dtype.element_ty), mask=m_g)
                if t < STEPS - 1:  # the draft rows' B / C windows read the slot's old taps: before the slot's
                    dst_window = conv_ptr + tl.load(spec_ptr + seq * stride_spec_b + t * stride_spec_k).to(tl.int64) \
                        * stride_conv
                    _window_write(dst_window, b_ch, m_n, _window_after(base, window, b_ch, m_n, stride_xbc, t, KW,
                                                                       KW_P2, BLOCK_N), KW, KW_P2)
                    _window_write(dst_window, c_ch, m_n, _window_after(base, window, c_ch, m_n, stride_xbc, t, KW,
                                                                       KW_P2, BLOCK_N), KW, KW_P2)
            b_last = _window_after(base, window, b_ch, m_n, stride_xbc, STEPS - 1, KW, KW_P2, BLOCK_N)
            c_last = _window_after(base, window, c_ch, m_n, stride_xbc, STEPS - 1, KW, KW_P2, BLOCK_N)
            tl.debug_barrier()  # every thread's reads of the slot's old B / C taps are done
            _window_write(window, b_ch, m_n, b_last, KW, KW_P2)
            _window_write(window, c_ch, m_n, c_last, KW, KW_P2)
            tl.store(ticket_at, 0)  # ready for the next launch (and graph replay)


def verify_config(batch: int, head_dim: int, n_state: int, device: torch.device, config: dict | None = None) -> dict:
    """The decode step's launch config at ``batch`` sequences (the same grid), overlaid by the table's
    "mamba_verify" entries where it has them (the decode's format: "default", ``p{P}_n{N}``, "by_batch"),
    then ``config``."""
    key = f"p{next_power_of_2(head_dim)}_n{next_power_of_2(n_state)}"
    cfg = kernel_config(TUNING_PACKAGE, "mamba_verify", key, decode_config(batch, head_dim, n_state, device), device)
    by_batch = cfg.pop("by_batch", None) or {}
    fits = [int(limit) for limit in by_batch if int(limit) >= batch]
    if fits:
        cfg.update(by_batch[str(min(fits))])
    return {**cfg, **(config or {})}


def _check(xbc: torch.Tensor, z: torch.Tensor, dt: torch.Tensor, conv_weight: torch.Tensor, conv_states: torch.Tensor,
           ssm_states: torch.Tensor, state_slots: torch.Tensor, spec_rows: torch.Tensor, heads: int,
           head_dim: int) -> int:
    """Validates the shapes and strides; returns the group count."""
    conv_dim = xbc.shape[1]
    n_state = ssm_states.shape[-1]
    d_inner = heads * head_dim
    groups = (conv_dim - d_inner) // (2 * n_state)
    kw = conv_weight.shape[1]
    batch, drafts = spec_rows.shape
    if kw < 2 or groups < 1 or heads % groups or conv_dim != d_inner + 2 * groups * n_state:
        raise ValueError(f"mamba_verify_step: conv_dim {conv_dim} is not {d_inner} + 2 x groups x {n_state} "
                         f"(or the conv width {kw} is under 2)")
    if xbc.shape[0] != batch * (drafts + 1) or z.shape != (xbc.shape[0], d_inner) or dt.shape != (xbc.shape[0], heads):
        raise ValueError(f"mamba_verify_step: xbc {tuple(xbc.shape)} z {tuple(z.shape)} dt {tuple(dt.shape)} are not "
                         f"{batch} x {drafts + 1} rows (spec_rows {tuple(spec_rows.shape)})")
    if state_slots.shape != (batch,) or (batch > 1 and state_slots.stride(0) != 1):
        raise ValueError(f"mamba_verify_step: state_slots {tuple(state_slots.shape)} is not a unit-stride [{batch}]")
    if conv_states.shape[1:] != (conv_dim, kw - 1) or conv_states.stride(2) != 1 or conv_states.stride(1) != kw - 1:
        raise ValueError(f"mamba_verify_step: conv_states {tuple(conv_states.shape)} is not [slots, {conv_dim}, "
                         f"{kw - 1}]")
    if ssm_states.shape[1:] != (heads, head_dim, n_state) or ssm_states.stride(3) != 1 or \
            ssm_states.stride(2) != n_state or ssm_states.stride(1) != head_dim * n_state:
        raise ValueError(f"mamba_verify_step: ssm_states {tuple(ssm_states.shape)} is not [slots, {heads}, "
                         f"{head_dim}, {n_state}] with each slot contiguous")
    if xbc.stride(1) != 1 or z.stride(1) != 1 or dt.stride(1) != 1 or conv_weight.stride(1) != 1:
        raise ValueError("mamba_verify_step: xbc, z, dt and conv_weight need unit stride along their last dim")
    return groups


def mamba_verify_step(xbc: torch.Tensor, z: torch.Tensor, dt: torch.Tensor, conv_weight: torch.Tensor,
                      conv_bias: torch.Tensor | None, conv_states: torch.Tensor, A_log: torch.Tensor, D: torch.Tensor,
                      dt_bias: torch.Tensor, dt_min: float, norm_weight: torch.Tensor, eps: float,
                      ssm_states: torch.Tensor, state_slots: torch.Tensor, spec_rows: torch.Tensor, heads: int,
                      head_dim: int, config: dict | None = None) -> torch.Tensor:
    """The Mamba-2 mixer of a verify step, between in_proj and out_proj. xbc [B·(K+1), conv_dim], z
    [B·(K+1), H·P], dt [B·(K+1), H] raw, sequence-major (sequence b's K + 1 positions in rows b·(K+1)..),
    column views of in_proj's output are fine; spec_rows [B, K] int (any strides): the state rows
    positions 0..K-1 write, distinct from every live slot; position K writes ``state_slots`` [B].
    Every other argument as ``mamba_decode_step``; the same as K + 1 chained ``mamba_decode_step``
    launches (``chained_decode_verify``). Returns [B·(K+1), H·P] in xbc's dtype. Padding rows may
    share a scratch slot and scratch spec rows (their content then ends unspecified)."""
    num_rows = xbc.shape[0]
    batch, drafts = spec_rows.shape
    groups = _check(xbc, z, dt, conv_weight, conv_states, ssm_states, state_slots, spec_rows, heads, head_dim)
    n_state, kw, d_inner = ssm_states.shape[-1], conv_weight.shape[1], heads * head_dim
    out = torch.empty(num_rows, d_inner, dtype=xbc.dtype, device=xbc.device)
    if batch == 0:
        return out
    steps, hpg = drafts + 1, heads // groups
    cfg = verify_config(batch, head_dim, n_state, xbc.device, config)
    split_p = int(cfg["split_p"]) or next_power_of_2(head_dim)  # 0 (the decode's group walk): whole heads
    if split_p & (split_p - 1):
        raise ValueError(f"mamba_verify_step: split_p {split_p} is not a power of two")
    block_p = min(split_p, next_power_of_2(head_dim))
    n_blocks = cdiv(head_dim, block_p)
    tickets = ticket_buffer(xbc.device, batch * groups)
    scratch = device_buffer("mamba_verify_rows", xbc.device, num_rows * (d_inner + heads * n_blocks), torch.float32,
                            zeroed=False)
    rows, partials = scratch, scratch[num_rows * d_inner:]  # [B·S, H·P] gated rows, then [B·S, H, NP] sums
    _mamba_verify_kernel[(batch, heads, n_blocks)](
        xbc, z, dt, conv_weight, conv_bias if conv_bias is not None else conv_weight, conv_states, A_log, D, dt_bias,
        norm_weight, ssm_states, state_slots, spec_rows, out, tickets, rows, partials,
        xbc.stride(0), z.stride(0), dt.stride(0), conv_weight.stride(0), conv_states.stride(0), ssm_states.stride(0),
        out.stride(0), spec_rows.stride(0), spec_rows.stride(1), float(dt_min), float(eps),
        GROUPS=groups, HPG=hpg, P=head_dim, N=n_state, KW=kw, KW_P2=next_power_of_2(kw),
        HAS_BIAS=conv_bias is not None, BLOCK_P=block_p, BLOCK_N=next_power_of_2(n_state), NP=n_blocks,
        PARTS_P2=next_power_of_2(hpg * n_blocks), BLOCK_G=next_power_of_2(hpg * head_dim), STEPS=steps,
        num_warps=cfg["num_warps"], **launch_options(xbc.device),
    )
    return out


def chained_decode_verify(xbc: torch.Tensor, z: torch.Tensor, dt: torch.Tensor, conv_weight: torch.Tensor,
                          conv_bias: torch.Tensor | None, conv_states: torch.Tensor, A_log: torch.Tensor,
                          D: torch.Tensor, dt_bias: torch.Tensor, dt_min: float, norm_weight: torch.Tensor, eps: float,
                          ssm_states: torch.Tensor, state_slots: torch.Tensor, spec_rows: torch.Tensor, heads: int,
                          head_dim: int, config: dict | None = None) -> torch.Tensor:
    """``mamba_verify_step`` as K + 1 ``mamba_decode_step`` launches, each after copying its source rows
    (the slot for position 0, else the row position i - 1 wrote) into its destination rows: [B·(K+1), H·P]."""
    batch, drafts = spec_rows.shape
    steps = drafts + 1
    outs = []
    for i in range(steps):
        src = state_slots if i == 0 else spec_rows[:, i - 1]
        dst = (spec_rows[:, i] if i < drafts else state_slots).contiguous()  # the kernel reads unit-stride slots
        conv_states.index_copy_(0, dst, conv_states.index_select(0, src))
        ssm_states.index_copy_(0, dst, ssm_states.index_select(0, src))
        outs.append(mamba_decode_step(xbc[i::steps], z[i::steps], dt[i::steps], conv_weight, conv_bias, conv_states,
                                      A_log, D, dt_bias, dt_min, norm_weight, eps, ssm_states, dst, heads, head_dim,
                                      config))
    return torch.stack(outs, dim=1).reshape(batch * steps, -1)
