"""One fused Mamba-2 decode step per layer in Triton: conv window update (+ bias, SiLU), selective state update, D skip and the grouped gated RMSNorm.

Two launch shapes, picked per batch size from the tuning table (``split_p``):

* ``split_p = 0`` (group walk): a program owns one (sequence, Mamba group). The norm groups of
  Nemotron-H's gated RMSNorm are d_inner / n_groups channels, exactly the H / G heads that share
  the group's B and C, so every conv channel a program reads and rewrites (its heads' x, its
  group's B and C), every state tile and every norm statistic it needs belong to no other program.
  It walks its heads one [P, N] fp32 state tile at a time: S <- e^{dt·A}·S + dt·x ⊗ B,
  y = S·C + D·x, then writes w · norm(y · silu(z)). Few programs: (B, G), 8 at batch 1 on Nano.
* ``split_p = BP`` (row split): a program owns one (sequence, head, BP state rows), (B, H,
  cdiv(P, BP)) programs, which is what keeps the memory system busy at batch 1. The update is
  row-local (row p reads only x[p] and the group's B, C), so two things cross programs, both
  settled by a per-(sequence, group) ticket counter as in the GDN value split: the group's B / C
  conv windows, which every program recomputes from the old window and only the last arriver
  shifts; and the group's RMSNorm, for which each program leaves its fp32 gated rows and its sum of
  squares in scratch and the last arriver sums the partials in a fixed order (deterministic) and
  writes the normalised group, then puts the counter back to zero. Nobody waits on anybody.

Both are one launch whose grid depends only on the batch size, with nothing read back, so the step
is CUDA-graph capturable; tickets and scratch are core's per-device ``device_buffers``.

Inside a program the compiler may hold one element in several threads (a [N] vector broadcast
over a [P, N] tile lives in every warp) and picks load and store layouts independently, so a value
read from a window or state tile and the overwrite of that element need not share a thread. Every
in-place update is therefore read-all, ``tl.debug_barrier()``, write: the new windows are built in
registers from loads (no shifting in memory), and head h's state and x window are stored only
after the barrier that follows every load of them (head h + 1's loads go out before it, to overlap).
References: ``naive.causal_conv1d_update_ref``, ``naive.selective_state_update_ref`` and core's
``gated_rms_norm`` (``norm_before_gate=False``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from armillary.kernels.triton.device_buffers import device_buffer, ticket_buffer
from armillary.kernels.triton.host import cdiv, next_power_of_2
from armillary.kernels.tuning import kernel_config

TUNING_PACKAGE = "armillary_nemotron"
# split_p: 0 walks each group in one program; a power of two splits every head in blocks of that many state rows
DECODE_DEFAULTS = {"num_warps": 8, "split_p": 0}


@triton.jit
def _conv_read(row, window, w_ptr, bias_ptr, ch, mask, stride_w, KW: tl.constexpr, KW_P2: tl.constexpr,
               HAS_BIAS: tl.constexpr):
    """Loads only. Channels ``ch`` [C]: silu(conv) of the new token [C] fp32, and their next window
    [C, KW_P2] in the window's dtype (tap j <- old tap j + 1, the last tap <- the new input)."""
    x = tl.load(row + ch, mask=mask, other=0.0)  # [C]
    acc = tl.load(w_ptr + ch * stride_w + (KW - 1), mask=mask, other=0.0).to(tl.float32) * x.to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + ch, mask=mask, other=0.0).to(tl.float32)
    # the taps one [C] vector at a time: a [C, K] tile's row sums would pin the layout of everything after
    for m in tl.static_range(KW - 1):
        old = tl.load(window + ch * (KW - 1) + m, mask=mask, other=0.0)
        acc += tl.load(w_ptr + ch * stride_w + m, mask=mask, other=0.0).to(tl.float32) * old.to(tl.float32)
    col = tl.arange(0, KW_P2)
    later = tl.load(window + ch[:, None] * (KW - 1) + col[None, :] + 1, mask=mask[:, None] & (col < KW - 2)[None, :],
                    other=0.0)  # [C, KW_P2] old taps 1 .. K-2 at columns 0 .. K-3
    new = tl.where((col == KW - 2)[None, :], x.to(window.dtype.element_ty)[:, None], later)
    return acc * tl.sigmoid(acc), new


@triton.jit
def _window_write(window, ch, mask, new, KW: tl.constexpr, KW_P2: tl.constexpr):
    """Stores the windows ``_conv_read`` built; call only after a barrier that follows its loads."""
    col = tl.arange(0, KW_P2)
    tl.store(window + ch[:, None] * (KW - 1) + col[None, :], new, mask=mask[:, None] & (col < KW - 1)[None, :])


@triton.jit
def _mamba_decode_kernel(
    xbc_ptr, z_ptr, dt_ptr, w_ptr, bias_ptr, conv_ptr, a_log_ptr, d_ptr, dt_bias_ptr, norm_w_ptr, states_ptr, slots_ptr,
    out_ptr, stride_xbc, stride_z, stride_dt, stride_w, stride_conv, stride_state, stride_out, dt_min, eps,
    GROUPS: tl.constexpr, HPG: tl.constexpr, P: tl.constexpr, N: tl.constexpr, KW: tl.constexpr,
    KW_P2: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    row = xbc_ptr + seq * stride_xbc
    window = conv_ptr + slot * stride_conv
    state_row = states_ptr + slot * stride_state

    hs = tl.arange(0, BLOCK_H)
    ps = tl.arange(0, BLOCK_P)
    ns = tl.arange(0, BLOCK_N)
    m_p = ps < P
    m_n = ns < N
    m_state = m_p[:, None] & m_n[None, :]
    tile = ps[:, None] * N + ns[None, :]  # [BP, BN] inside one head's [P, N] state
    head0 = group * HPG
    b_ch = GROUPS * HPG * P + group * N + ns
    c_ch = b_ch + GROUPS * N
    # the first head's tile goes out first (the long load), then the group's B and C
    s_next = tl.load(state_row + head0 * P * N + tile, mask=m_state, other=0.0)
    x_next, xw_next = _conv_read(row, window, w_ptr, bias_ptr, head0 * P + ps, m_p, stride_w, KW, KW_P2, HAS_BIAS)
    bv, b_win = _conv_read(row, window, w_ptr, bias_ptr, b_ch, m_n, stride_w, KW, KW_P2, HAS_BIAS)
    cv, c_win = _conv_read(row, window, w_ptr, bias_ptr, c_ch, m_n, stride_w, KW, KW_P2, HAS_BIAS)

    y_all = tl.zeros([BLOCK_H, BLOCK_P], dtype=tl.float32)
    for h in tl.static_range(HPG):
        head = head0 + h
        state = s_next.to(tl.float32)
        x = x_next
        x_win = xw_next
        if h + 1 < HPG:  # the next head's loads are issued before this head's barrier and stores
            s_next = tl.load(state_row + (head + 1) * P * N + tile, mask=m_state, other=0.0)
            x_next, xw_next = _conv_read(row, window, w_ptr, bias_ptr, (head + 1) * P + ps, m_p, stride_w, KW, KW_P2,
                                         HAS_BIAS)
        raw = tl.load(dt_ptr + seq * stride_dt + head).to(tl.float32) + tl.load(dt_bias_ptr + head).to(tl.float32)
        dt = tl.maximum(tl.where(raw > 20.0, raw, tl.log(1.0 + tl.exp(raw))), dt_min)
        decay = tl.exp(-dt * tl.exp(tl.load(a_log_ptr + head).to(tl.float32)))  # A = -exp(A_log)
        state = state * decay + (dt * x)[:, None] * bv[None, :]  # [BP, BN]
        y = tl.sum(state * cv[None, :], axis=1) + tl.load(d_ptr + head).to(tl.float32) * x  # [BP]
        y_all = tl.where((hs == h)[:, None], y[None, :], y_all)
        # every thread's reads of head h's old tile and x window (and, at h == 0, of the B / C windows) are done
        tl.debug_barrier()
        tl.store(state_row + head * P * N + tile, state.to(states_ptr.dtype.element_ty), mask=m_state)
        _window_write(window, head * P + ps, m_p, x_win, KW, KW_P2)
        if h == 0:
            _window_write(window, b_ch, m_n, b_win, KW, KW_P2)
            _window_write(window, c_ch, m_n, c_win, KW, KW_P2)

    m_hp = (hs < HPG)[:, None] & m_p[None, :]
    x_ch = (head0 + hs)[:, None] * P + ps[None, :]  # [BH, BP] this group's output channels
    z = tl.load(z_ptr + seq * stride_z + x_ch, mask=m_hp, other=0.0).to(tl.float32)
    gated = tl.where(m_hp, y_all * z * tl.sigmoid(z), 0.0)
    inv = tl.rsqrt(tl.sum(tl.sum(gated * gated, axis=1), axis=0) / (HPG * P) + eps)
    w = tl.load(norm_w_ptr + x_ch, mask=m_hp, other=0.0).to(tl.float32)
    tl.store(out_ptr + seq * stride_out + x_ch, (gated * inv * w).to(out_ptr.dtype.element_ty), mask=m_hp)


@triton.jit
def _mamba_decode_split_kernel(
    xbc_ptr, z_ptr, dt_ptr, w_ptr, bias_ptr, conv_ptr, a_log_ptr, d_ptr, dt_bias_ptr, norm_w_ptr, states_ptr, slots_ptr,
    out_ptr, tickets_ptr, rows_ptr, partials_ptr, stride_xbc, stride_z, stride_dt, stride_w, stride_conv,
    stride_state, stride_out, dt_min, eps,
    GROUPS: tl.constexpr, HPG: tl.constexpr, P: tl.constexpr, N: tl.constexpr, KW: tl.constexpr,
    KW_P2: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, NP: tl.constexpr,
    PARTS_P2: tl.constexpr, BLOCK_G: tl.constexpr,
):
    """Program (sequence, head, block of BLOCK_P state rows): one [BLOCK_P, N] tile. The group's B / C
    windows and its norm cross programs: the last of the group's HPG · NP programs to take the
    (sequence, group) ticket shifts the B / C windows and writes the normalised group from the
    others' fp32 gated rows (rows_ptr [B, H·P]) and sums of squares (partials_ptr [B, H, NP])."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    block = tl.program_id(2)
    group = head // HPG
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    row = xbc_ptr + seq * stride_xbc
    window = conv_ptr + slot * stride_conv
    state_ptrs = states_ptr + slot * stride_state + head * P * N

    ps = block * BLOCK_P + tl.arange(0, BLOCK_P)
    ns = tl.arange(0, BLOCK_N)
    m_p = ps < P
    m_n = ns < N
    m_state = m_p[:, None] & m_n[None, :]
    tile = ps[:, None] * N + ns[None, :]  # [BP, BN] inside the head's [P, N] state
    s = tl.load(state_ptrs + tile, mask=m_state, other=0.0)  # the one long load goes out first
    x_ch = head * P + ps
    x, x_win = _conv_read(row, window, w_ptr, bias_ptr, x_ch, m_p, stride_w, KW, KW_P2, HAS_BIAS)
    b_ch = GROUPS * HPG * P + group * N + ns
    c_ch = b_ch + GROUPS * N
    bv, b_win = _conv_read(row, window, w_ptr, bias_ptr, b_ch, m_n, stride_w, KW, KW_P2, HAS_BIAS)
    cv, c_win = _conv_read(row, window, w_ptr, bias_ptr, c_ch, m_n, stride_w, KW, KW_P2, HAS_BIAS)
    z = tl.load(z_ptr + seq * stride_z + x_ch, mask=m_p, other=0.0).to(tl.float32)
    raw = tl.load(dt_ptr + seq * stride_dt + head).to(tl.float32) + tl.load(dt_bias_ptr + head).to(tl.float32)
    dt = tl.maximum(tl.where(raw > 20.0, raw, tl.log(1.0 + tl.exp(raw))), dt_min)
    decay = tl.exp(-dt * tl.exp(tl.load(a_log_ptr + head).to(tl.float32)))  # A = -exp(A_log)

    state = s.to(tl.float32) * decay + (dt * x)[:, None] * bv[None, :]  # [BP, BN]
    y = tl.sum(state * cv[None, :], axis=1) + tl.load(d_ptr + head).to(tl.float32) * x  # [BP]
    gated = tl.where(m_p, y * z * tl.sigmoid(z), 0.0)
    sum_sq = tl.sum(gated * gated, axis=0)
    if HPG * NP == 1:  # the program holds its whole group: nothing crosses programs
        w = tl.load(norm_w_ptr + x_ch, mask=m_p, other=0.0).to(tl.float32)
        inv = tl.rsqrt(sum_sq / (HPG * P) + eps)
        tl.store(out_ptr + seq * stride_out + x_ch, (gated * inv * w).to(out_ptr.dtype.element_ty), mask=m_p)
        tl.debug_barrier()  # every thread's reads of the old tile and windows are done
        tl.store(state_ptrs + tile, state.to(states_ptr.dtype.element_ty), mask=m_state)
        _window_write(window, x_ch, m_p, x_win, KW, KW_P2)
        _window_write(window, b_ch, m_n, b_win, KW, KW_P2)
        _window_write(window, c_ch, m_n, c_win, KW, KW_P2)
    else:
        d_inner = GROUPS * HPG * P
        tl.store(rows_ptr + seq * d_inner + x_ch, gated, mask=m_p)
        tl.store(partials_ptr + (seq * GROUPS * HPG + head) * NP + block, sum_sq)
        # every thread has read the old windows and tile and made its scratch stores before the release
        tl.debug_barrier()
        ticket_at = tickets_ptr + seq * GROUPS + group
        ticket = tl.atomic_add(ticket_at, 1, sem="acq_rel")
        # the tile and the x window are this program's alone: stored after the ticket, which need not wait
        tl.store(state_ptrs + tile, state.to(states_ptr.dtype.element_ty), mask=m_state)
        _window_write(window, x_ch, m_p, x_win, KW, KW_P2)
        if ticket == HPG * NP - 1:  # the last of the group: every old B / C window read, every partial written
            o = tl.arange(0, PARTS_P2)
            # .cg: straight from L2, where the other programs' stores are; a fixed order: deterministic
            parts = tl.load(partials_ptr + (seq * GROUPS + group) * HPG * NP + o, mask=o < HPG * NP, other=0.0,
                            cache_modifier=".cg")
            inv = tl.rsqrt(tl.sum(parts, axis=0) / (HPG * P) + eps)
            g_off = tl.arange(0, BLOCK_G)
            m_g = g_off < HPG * P
            g_ch = group * HPG * P + g_off
            g = tl.load(rows_ptr + seq * d_inner + g_ch, mask=m_g, other=0.0, cache_modifier=".cg")
            w = tl.load(norm_w_ptr + g_ch, mask=m_g, other=0.0).to(tl.float32)
            tl.store(out_ptr + seq * stride_out + g_ch, (g * inv * w).to(out_ptr.dtype.element_ty), mask=m_g)
            _window_write(window, b_ch, m_n, b_win, KW, KW_P2)
            _window_write(window, c_ch, m_n, c_win, KW, KW_P2)
            tl.store(ticket_at, 0)  # ready for the next launch (and graph replay)


def decode_config(batch: int, head_dim: int, n_state: int, device: torch.device, config: dict | None = None) -> dict:
    """The launch config for ``batch`` tokens: defaults, the table's "default" and ``p{P}_n{N}`` entries
    (a ``"by_batch"`` map {"max batch": overrides} applies its smallest key >= batch), then ``config``."""
    key = f"p{next_power_of_2(head_dim)}_n{next_power_of_2(n_state)}"
    cfg = kernel_config(TUNING_PACKAGE, "mamba_decode", key, DECODE_DEFAULTS, device)
    by_batch = cfg.pop("by_batch", None) or {}
    fits = [int(limit) for limit in by_batch if int(limit) >= batch]
    if fits:
        cfg.update(by_batch[str(min(fits))])
    return {**cfg, **(config or {})}


def mamba_decode_step(xbc: torch.Tensor, z: torch.Tensor, dt: torch.Tensor, conv_weight: torch.Tensor,
                      conv_bias: torch.Tensor | None, conv_states: torch.Tensor, A_log: torch.Tensor, D: torch.Tensor,
                      dt_bias: torch.Tensor, dt_min: float, norm_weight: torch.Tensor, eps: float,
                      ssm_states: torch.Tensor, state_slots: torch.Tensor, heads: int, head_dim: int,
                      config: dict | None = None) -> torch.Tensor:
    """One new token per sequence. xbc [B, conv_dim] (x ‖ B ‖ C before the conv), z [B, H·P], dt [B, H]
    raw: column views of in_proj's output are fine (unit last stride). conv_weight [conv_dim, K],
    conv_states [slots, conv_dim, K-1] and ssm_states [slots, H, P, N] (each slot contiguous) are
    updated at ``state_slots``; A_log [H] fp32 (A = -exp(A_log) is taken in the kernel: no launch for
    it). Returns norm(y · silu(z)) · w [B, H·P] in xbc's dtype, normalised per group of H / G heads.
    A slot may appear twice only when it is scratch (CUDA-graph padding rows): its content then ends
    unspecified; every live slot once."""
    num_seqs, conv_dim = xbc.shape
    n_state = ssm_states.shape[-1]
    d_inner = heads * head_dim
    groups = (conv_dim - d_inner) // (2 * n_state)
    kw = conv_weight.shape[1]
    if kw < 2 or groups < 1 or heads % groups or conv_dim != d_inner + 2 * groups * n_state:
        raise ValueError(f"mamba_decode_step: conv_dim {conv_dim} is not {d_inner} + 2 x groups x {n_state} "
                         f"(or the conv width {kw} is under 2)")
    if conv_states.shape[1:] != (conv_dim, kw - 1) or conv_states.stride(2) != 1 or conv_states.stride(1) != kw - 1:
        raise ValueError(f"mamba_decode_step: conv_states {tuple(conv_states.shape)} is not [slots, {conv_dim}, {kw - 1}]")
    if ssm_states.shape[1:] != (heads, head_dim, n_state) or ssm_states.stride(3) != 1 or \
            ssm_states.stride(2) != n_state or ssm_states.stride(1) != head_dim * n_state:
        raise ValueError(f"mamba_decode_step: ssm_states {tuple(ssm_states.shape)} is not [slots, {heads}, "
                         f"{head_dim}, {n_state}] with each slot contiguous")
    if xbc.stride(1) != 1 or z.stride(1) != 1 or dt.stride(1) != 1 or conv_weight.stride(1) != 1:
        raise ValueError("mamba_decode_step: xbc, z, dt and conv_weight need unit stride along their last dim")
    out = torch.empty(num_seqs, d_inner, dtype=xbc.dtype, device=xbc.device)
    if num_seqs == 0:
        return out
    cfg = decode_config(num_seqs, head_dim, n_state, xbc.device, config)
    hpg = heads // groups
    common = dict(GROUPS=groups, HPG=hpg, P=head_dim, N=n_state, KW=kw, KW_P2=next_power_of_2(kw),
                  HAS_BIAS=conv_bias is not None, BLOCK_N=next_power_of_2(n_state), num_warps=cfg["num_warps"])
    args = (xbc, z, dt, conv_weight, conv_bias if conv_bias is not None else conv_weight, conv_states, A_log, D, dt_bias,
            norm_weight, ssm_states, state_slots, out)
    strides = (xbc.stride(0), z.stride(0), dt.stride(0), conv_weight.stride(0), conv_states.stride(0),
               ssm_states.stride(0), out.stride(0), float(dt_min), float(eps))
    split_p = int(cfg["split_p"])
    if split_p:
        if split_p & (split_p - 1):
            raise ValueError(f"mamba_decode_step: split_p {split_p} is not a power of two")
        block_p = min(split_p, next_power_of_2(head_dim))
        n_blocks = cdiv(head_dim, block_p)
        tickets = ticket_buffer(xbc.device, num_seqs * groups)
        scratch = device_buffer("mamba_decode_rows", xbc.device, num_seqs * (d_inner + heads * n_blocks),
                                torch.float32, zeroed=False)
        rows, partials = scratch, scratch[num_seqs * d_inner:]  # [B, H·P] gated rows, then [B, H, NP] sums
        _mamba_decode_split_kernel[(num_seqs, heads, n_blocks)](
            *args, tickets, rows, partials, *strides, BLOCK_P=block_p, NP=n_blocks,
            PARTS_P2=next_power_of_2(hpg * n_blocks), BLOCK_G=next_power_of_2(hpg * head_dim), **common,
        )
        return out
    _mamba_decode_kernel[(num_seqs, groups)](
        *args, *strides, BLOCK_H=next_power_of_2(hpg), BLOCK_P=next_power_of_2(head_dim), **common,
    )
    return out
