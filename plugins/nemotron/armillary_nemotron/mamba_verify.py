"""A speculative verify step through a Mamba-2 mixer: the conv window and SSM state after every verified position kept in its own state row.

Every sequence of a verify step has K + 1 tokens. Position i < K continues from the state after
position i - 1 (the slot's for i = 0) and leaves its own in ``spec_state_rows[:, i]``; position K
leaves it in the slot, so the state after any accepted prefix survives and the scheduler commits
it (``pending_state_row``). The fast path is one fused Triton launch per layer
(``ops.mamba.verify.mamba_verify_step``: the state kept in registers across the positions, no row
copies, capturable in a CUDA graph); the reference copies each position's source rows into its
destination rows and takes one fp32 step there (``naive.verify_steps_ref``).
"""
from __future__ import annotations

import torch

from armillary.forward_batch import ForwardBatch
from armillary_nemotron.ops.mamba.naive import verify_steps_ref


def mamba_verify(mixer, projected: torch.Tensor, batch: ForwardBatch, conv_states: torch.Tensor,
                 ssm_states: torch.Tensor, fast: bool) -> torch.Tensor:
    """mixer: the ``Mamba2Mixer``; projected: [B (K+1), d_inner + conv_dim + H] its in_proj output
    -> gated-normed y [B (K+1), d_inner] in projected's dtype (before out_proj)."""
    rows = batch.spec_state_rows  # [B, K], any strides (the verify graphs pass a transposed view)
    z, xbc, dt = projected.split([mixer.d_inner, mixer.conv_dim, mixer.heads], dim=-1)
    if fast:
        from armillary_nemotron.ops.mamba.verify import mamba_verify_step

        return mamba_verify_step(xbc, z, dt, mixer.conv1d.weight[:, 0], mixer.conv1d.bias, conv_states, mixer.A_log,
                                 mixer.D, mixer.dt_bias, mixer.dt_min, mixer.norm.weight, mixer.norm.eps, ssm_states,
                                 batch.state_slots, rows, mixer.heads, mixer.head_dim)
    y = verify_steps_ref(xbc, dt, mixer.conv1d.weight[:, 0], mixer.conv1d.bias, -torch.exp(mixer.A_log), mixer.D,
                         mixer.dt_bias, mixer.dt_min, conv_states, ssm_states, batch.state_slots, rows, mixer.heads,
                         mixer.head_dim)  # [B (K+1), H, P] fp32
    return mixer.gated_norm(y.reshape(-1, mixer.d_inner), z).to(projected.dtype)
