"""The Mamba-2 mixer of Nemotron-H: in_proj -> z | xBC | dt, causal conv + SiLU, SSD scan, grouped gated RMSNorm, out_proj.

Prefill chunks (and batches that mix them with decodes) run core's varlen causal conv1d, the
chunked SSD scan (parallel over chunks for long batches) and the grouped gated norm reading z in
place, each sequence continuing from its slot's conv window and fp32 SSM state and writing them
back; decode-only steps on the Triton path run one fused decode kernel (conv update, selective
state update, D skip, softplus dt, gated norm; A = -exp(A_log) taken inside), which reads no host
list, so the step can be captured in a CUDA graph: in_proj, that kernel and out_proj per layer.
Speculative verify steps go through ``mamba_verify`` (a state row per verified position).
dt = max(softplus(dt + dt_bias), time_step_min) on both paths (transformers applies the floor in
its chunked path only; a floor that differs between paths would make a recomputed prefix differ).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import skip_init

from armillary.forward_batch import ForwardBatch, RecurrentState
from armillary.kernels import ops
from armillary.layers import GatedRMSNorm, ReplicatedLinear
from armillary_nemotron.config import NemotronHArgs
from armillary_nemotron.mamba_verify import mamba_verify
from armillary_nemotron.ops.mamba.naive import ssd_chunk_scan_ref


class Mamba2Mixer(nn.Module):
    """Parameters as in the checkpoint: ``in_proj`` [d_inner + conv_dim + H, hidden] (rows z | x ‖ B ‖ C | dt),
    ``conv1d.weight`` [conv_dim, 1, K] (+ ``conv1d.bias``), ``A_log``, ``D``, ``dt_bias`` [H] float32,
    ``norm.weight`` [d_inner], ``out_proj``. Replicated on every tensor-parallel rank (the state is
    per head, and the whole mixer is a few percent of a step)."""

    def __init__(self, cfg: NemotronHArgs, prefix: str = "") -> None:
        super().__init__()
        self.heads, self.head_dim = cfg.mamba_heads, cfg.mamba_head_dim
        self.groups, self.state_size = cfg.n_groups, cfg.state_size
        self.d_inner, self.conv_dim = cfg.d_inner, cfg.conv_dim
        self.chunk_size, self.dt_min = cfg.chunk_size, cfg.dt_min
        if self.heads % self.groups:
            raise ValueError(f"mamba_num_heads {self.heads} is not a multiple of n_groups {self.groups}")
        self.in_proj = ReplicatedLinear(cfg.hidden_size, self.d_inner + self.conv_dim + self.heads,
                                        bias=cfg.mamba_proj_bias, prefix=f"{prefix}.in_proj")
        self.conv1d = skip_init(nn.Conv1d, self.conv_dim, self.conv_dim, cfg.conv_kernel, groups=self.conv_dim,
                                bias=cfg.conv_bias, device=torch.get_default_device())
        # the SSM parameters stay float32 whatever the model dtype
        self.A_log = nn.Parameter(torch.empty(self.heads, dtype=torch.float32), requires_grad=False)
        self.D = nn.Parameter(torch.empty(self.heads, dtype=torch.float32), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.heads, dtype=torch.float32), requires_grad=False)
        self.norm = GatedRMSNorm(self.d_inner, cfg.eps, group_size=self.d_inner // self.groups,
                                 norm_before_gate=False)
        self.out_proj = ReplicatedLinear(self.d_inner, cfg.hidden_size, bias=cfg.mamba_proj_bias,
                                         prefix=f"{prefix}.out_proj")

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: RecurrentState) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]; continues from and updates ``cache`` at ``batch.state_slots``."""
        conv_states, ssm_states = cache.tensors  # [slots, conv_dim, K-1], [slots, H, P, N] fp32
        projected = self.in_proj(x)  # [T, d_inner + conv_dim + H]
        z, xbc, dt = projected.split([self.d_inner, self.conv_dim, self.heads], dim=-1)
        weight, bias = self.conv1d.weight[:, 0], self.conv1d.bias
        slots = batch.state_slots
        gn = self.groups * self.state_size
        fast = ops.use_triton(x)
        if batch.spec_state_rows is not None:  # a speculative verify step: the state after every position kept
            return self.out_proj(mamba_verify(self, projected, batch, conv_states, ssm_states, fast))
        if fast and batch.is_decode_only:  # conv, state update and gated norm in one launch
            from armillary_nemotron.ops.mamba.decode import mamba_decode_step

            y = mamba_decode_step(xbc, z, dt, weight, bias, conv_states, self.A_log, self.D, self.dt_bias,
                                  self.dt_min, self.norm.weight, self.norm.eps, ssm_states, slots, self.heads,
                                  self.head_dim)
            return self.out_proj(y)
        xbc = ops.causal_conv1d(xbc, weight, bias, conv_states, slots, batch, activation="silu")  # [T, conv_dim]
        xs, B, C = xbc.split([self.d_inner, gn, gn], dim=-1)
        if fast:
            from armillary_nemotron.ops.mamba.gated_norm import gated_group_norm
            from armillary_nemotron.ops.mamba.ssd_scan import ssd_chunk_scan

            y = ssd_chunk_scan(xs, B, C, dt, self.A_log, self.D, self.dt_bias, self.dt_min, batch.query_start_loc,
                               ssm_states, slots, self.heads, self.head_dim)  # [T, d_inner]
            # norm(y · silu(z)) · w per group, z read in place (core's grouped norm would want a copy of it)
            return self.out_proj(gated_group_norm(y, z, self.norm.weight, self.norm.eps, self.norm.group_size))
        # the reference walks the sequences on the host (CPU path; never inside a CUDA graph)
        num_tokens = x.shape[0]
        A = -torch.exp(self.A_log)  # [H] (the Triton kernels take A_log: no launch for it)
        y = ssd_chunk_scan_ref(xs.reshape(num_tokens, self.heads, self.head_dim), dt, A,
                               B.reshape(num_tokens, self.groups, self.state_size),
                               C.reshape(num_tokens, self.groups, self.state_size), self.D, self.dt_bias,
                               self.dt_min, self.chunk_size, batch.query_start_loc_cpu, ssm_states, slots)
        y = y.reshape(num_tokens, self.d_inner)
        # norm(y · silu(z)) · w per group of d_inner / n_groups channels (the reference wants z contiguous)
        y = self.norm(y, z.contiguous())
        return self.out_proj(y.to(x.dtype))
