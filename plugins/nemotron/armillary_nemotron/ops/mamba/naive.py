"""Reference Mamba-2 SSD, float32, over packed varlen input: the chunked scan (prefill), the selective state update (decode) and chained verify steps.

Conventions (mamba_ssm / transformers): per head h, dt = max(softplus(dt_raw + dt_bias), dt_min),
dA = exp(dt · A) with A = -exp(A_log) < 0; the state S [P, N] evolves S <- dA · S + dt · x ⊗ B and
the output is y = S · C + D · x, B and C shared by the H / G heads of a group.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def discretize_dt(dt: torch.Tensor, dt_bias: torch.Tensor, dt_min: float) -> torch.Tensor:
    """dt_raw [..., H] -> softplus(dt_raw + dt_bias) clamped below by ``dt_min``, float32."""
    return F.softplus(dt.float() + dt_bias.float()).clamp(min=dt_min)


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """a [..., L] -> [..., L, L]: out[i, j] = sum(a[j+1 .. i]) for i >= j, -inf above the diagonal."""
    length = a.shape[-1]
    cs = torch.cumsum(a, dim=-1)
    out = cs[..., :, None] - cs[..., None, :]
    keep = torch.tril(torch.ones(length, length, dtype=torch.bool, device=a.device))
    return out.masked_fill(~keep, float("-inf"))


def ssd_chunk_scan_one(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                       chunk_size: int, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, chunked SSD: x [L, H, P], dt [L, H] (discretized), A [H], B, C [L, G, N],
    state [H, P, N] -> (y [L, H, P] without the D term, final state [H, P, N]); all float32."""
    length, heads, _ = x.shape
    groups = B.shape[1]
    B = B.repeat_interleave(heads // groups, dim=1)  # [L, H, N]
    C = C.repeat_interleave(heads // groups, dim=1)
    pad = (-length) % chunk_size
    xs, dts, Bs, Cs = (F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)) for t in (x, dt, B, C))
    n_chunks = (length + pad) // chunk_size
    xs = xs.reshape(n_chunks, chunk_size, heads, -1)  # [c, l, h, p]
    Bs = Bs.reshape(n_chunks, chunk_size, heads, -1)  # [c, l, h, n]
    Cs = Cs.reshape(n_chunks, chunk_size, heads, -1)
    a = (dts * A).reshape(n_chunks, chunk_size, heads).permute(0, 2, 1)  # [c, h, l] log decay per step
    xdt = xs * dts.reshape(n_chunks, chunk_size, heads, 1)
    a_cs = torch.cumsum(a, dim=-1)  # [c, h, l]
    decay = torch.exp(_segsum(a))  # [c, h, l, s]
    scores = torch.einsum("clhn,cshn->chls", Cs, Bs) * decay
    y_diag = torch.einsum("chls,cshp->clhp", scores, xdt)
    to_end = torch.exp(a_cs[..., -1:] - a_cs)  # [c, h, l]
    chunk_states = torch.einsum("clhn,chl,clhp->chpn", Bs, to_end, xdt)  # each chunk's own contribution
    outputs, states = [], state
    starts = []
    for c in range(n_chunks):
        starts.append(states)
        states = torch.exp(a_cs[c, :, -1])[:, None, None] * states + chunk_states[c]
    start = torch.stack(starts)  # [c, h, p, n] state entering each chunk
    y_off = torch.einsum("clhn,chpn->clhp", Cs, start) * torch.exp(a_cs).permute(0, 2, 1)[..., None]
    y = (y_diag + y_off).reshape(n_chunks * chunk_size, heads, -1)[:length]
    return y, states


def ssd_chunk_scan_ref(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                       D: torch.Tensor, dt_bias: torch.Tensor, dt_min: float, chunk_size: int,
                       cu_seqlens: Sequence[int], ssm_states: torch.Tensor,
                       state_slots: torch.Tensor) -> torch.Tensor:
    """Packed sequences: x [T, H, P], dt [T, H] (raw), B, C [T, G, N]; sequence b (tokens
    cu_seqlens[b]:cu_seqlens[b+1]) starts from ``ssm_states[state_slots[b]]`` [H, P, N] and writes
    its final state back. Returns y [T, H, P] float32 (D skip included)."""
    dt_d = discretize_dt(dt, dt_bias, dt_min)
    A = A.float()
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    for b, slot in enumerate(state_slots.tolist()):
        s, e = int(cu_seqlens[b]), int(cu_seqlens[b + 1])
        if e == s:
            continue
        out, final = ssd_chunk_scan_one(x[s:e].float(), dt_d[s:e], A, B[s:e].float(), C[s:e].float(), chunk_size,
                                        ssm_states[slot].float())
        y[s:e] = out + D.float()[:, None] * x[s:e].float()
        ssm_states[slot] = final.to(ssm_states.dtype)
    return y


def selective_state_update_ref(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                               D: torch.Tensor, dt_bias: torch.Tensor, dt_min: float, ssm_states: torch.Tensor,
                               state_slots: torch.Tensor) -> torch.Tensor:
    """One new token per sequence: x [B, H, P], dt [B, H] (raw), B, C [B, G, N]; updates
    ``ssm_states[state_slots]`` [B, H, P, N] in place; returns y [B, H, P] float32."""
    heads, groups = x.shape[1], B.shape[1]
    dt_d = discretize_dt(dt, dt_bias, dt_min)  # [B, H]
    Bh = B.float().repeat_interleave(heads // groups, dim=1)  # [B, H, N]
    Ch = C.float().repeat_interleave(heads // groups, dim=1)
    state = ssm_states[state_slots].float()  # [B, H, P, N]
    dA = torch.exp(dt_d * A.float())[..., None, None]
    state = dA * state + (dt_d[..., None] * x.float())[..., None] * Bh[:, :, None, :]
    ssm_states[state_slots] = state.to(ssm_states.dtype)
    return torch.einsum("bhpn,bhn->bhp", state, Ch) + D.float()[:, None] * x.float()


def causal_conv1d_update_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             conv_states: torch.Tensor, state_slots: torch.Tensor) -> torch.Tensor:
    """One new token per sequence: x [B, C], weight [C, K], conv_states [slots, C, K-1] (updated)
    -> silu(conv) [B, C] in x's dtype, float32 math."""
    window = torch.cat((conv_states[state_slots].float(), x.float()[:, :, None]), dim=2)  # [B, C, K]
    y = (window * weight.float()).sum(-1)
    if bias is not None:
        y = y + bias.float()
    conv_states[state_slots] = window[:, :, 1:].to(conv_states.dtype)
    return F.silu(y).to(x.dtype)


def verify_steps_ref(xbc: torch.Tensor, dt: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
                     A: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor, dt_min: float, conv_states: torch.Tensor,
                     ssm_states: torch.Tensor, state_slots: torch.Tensor, spec_rows: torch.Tensor, heads: int,
                     head_dim: int) -> torch.Tensor:
    """A speculative verify step as K + 1 chained one-token steps: xbc [B·(K+1), conv_dim] (x ‖ B ‖ C
    before the conv) and dt [B·(K+1), H] raw, sequence-major; position i copies the rows position
    i - 1 wrote (the slot's for i = 0) into ``spec_rows[:, i]`` [B, K] (i < K) or the slot (i = K)
    and steps there. Returns y [B·(K+1), H, P] float32 (D skip included, before the gated norm)."""
    num, drafts = spec_rows.shape
    steps = drafts + 1
    groups = (xbc.shape[1] - heads * head_dim) // (2 * ssm_states.shape[-1])
    n_state = ssm_states.shape[-1]
    ys = []
    for i in range(steps):
        src = state_slots if i == 0 else spec_rows[:, i - 1]
        dst = spec_rows[:, i] if i < drafts else state_slots
        conv_states[dst] = conv_states[src]
        ssm_states[dst] = ssm_states[src]
        act = causal_conv1d_update_ref(xbc[i::steps], conv_weight, conv_bias, conv_states, dst)  # [B, conv_dim]
        x, B, C = act.split([heads * head_dim, groups * n_state, groups * n_state], dim=-1)
        ys.append(selective_state_update_ref(x.reshape(num, heads, head_dim), dt[i::steps], A,
                                             B.reshape(num, groups, n_state), C.reshape(num, groups, n_state), D,
                                             dt_bias, dt_min, ssm_states, dst))  # [B, H, P]
    return torch.stack(ys, dim=1).reshape(num * steps, heads, head_dim)
