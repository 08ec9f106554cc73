"""A speculative verify step through a Mamba-2 mixer: the conv window and SSM state after every verified position kept in its own state row.

Every sequence of a verify step has K + 1 tokens. Position i < K continues from the state after
position i - 1 (the slot's for i = 0) and leaves its own in ``spec_state_rows[:, i]``; position K
leaves it in the slot, so the state after any accepted prefix survives and the scheduler commits
it (``pending_state_row``). Each position copies its source rows into its destination rows, then
runs one decode step there in place: the fused Triton decode kernel on the fast path (a launch and
two row copies per position, all capturable in a CUDA graph), the fp32 reference otherwise.
"""
from __future__ import annotations

import torch

from armillary.forward_batch import ForwardBatch
from armillary_nemotron.ops.mamba.naive import causal_conv1d_update_ref, selective_state_update_ref


def mamba_verify(mixer, projected: torch.Tensor, batch: ForwardBatch, conv_states: torch.Tensor,
                 ssm_states: torch.Tensor, fast: bool) -> torch.Tensor:
    """mixer: the ``Mamba2Mixer``; projected: [B (K+1), d_inner + conv_dim + H] its in_proj output
    -> gated-normed y [B (K+1), d_inner] in projected's dtype (before out_proj)."""
    rows = batch.spec_state_rows  # [B, K]
    num, k = rows.shape
    steps = projected.view(num, k + 1, -1)  # [B, K+1, P]
    outs = []
    for i in range(k + 1):
        src = batch.state_slots if i == 0 else rows[:, i - 1]
        dst = (rows[:, i] if i < k else batch.state_slots).contiguous()  # the kernels read unit-stride slots
        conv_states.index_copy_(0, dst, conv_states.index_select(0, src))
        ssm_states.index_copy_(0, dst, ssm_states.index_select(0, src))
        z, xbc, dt = steps[:, i].split([mixer.d_inner, mixer.conv_dim, mixer.heads], dim=-1)
        step = _fast_step if fast else _reference_step
        outs.append(step(mixer, xbc, z, dt, conv_states, ssm_states, dst))
    return torch.stack(outs, dim=1).reshape(num * (k + 1), mixer.d_inner)


def _fast_step(mixer, xbc: torch.Tensor, z: torch.Tensor, dt: torch.Tensor, conv_states: torch.Tensor,
               ssm_states: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    from armillary_nemotron.ops.mamba.decode import mamba_decode_step

    return mamba_decode_step(xbc, z, dt, mixer.conv1d.weight[:, 0], mixer.conv1d.bias, conv_states, mixer.A_log,
                             mixer.D, mixer.dt_bias, mixer.dt_min, mixer.norm.weight, mixer.norm.eps, ssm_states,
                             slots, mixer.heads, mixer.head_dim)  # [B, d_inner]


def _reference_step(mixer, xbc: torch.Tensor, z: torch.Tensor, dt: torch.Tensor, conv_states: torch.Tensor,
                    ssm_states: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One token per sequence in plain torch (fp32 math), updating ``slots``' rows in place: [B, d_inner]."""
    num = xbc.shape[0]
    gn = mixer.groups * mixer.state_size
    conv = causal_conv1d_update_ref(xbc, mixer.conv1d.weight[:, 0], mixer.conv1d.bias, conv_states, slots)
    xs, B, C = conv.split([mixer.d_inner, gn, gn], dim=-1)
    y = selective_state_update_ref(xs.reshape(num, mixer.heads, mixer.head_dim), dt, -torch.exp(mixer.A_log),
                                   B.reshape(num, mixer.groups, mixer.state_size),
                                   C.reshape(num, mixer.groups, mixer.state_size), mixer.D, mixer.dt_bias,
                                   mixer.dt_min, ssm_states, slots)  # [B, H, P] fp32
    return mixer.norm(y.reshape(num, mixer.d_inner), z.contiguous()).to(xbc.dtype)
