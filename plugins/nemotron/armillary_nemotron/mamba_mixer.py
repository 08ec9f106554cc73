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
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init

from armillary.errors import WeightLoadError
from armillary.forward_batch import ForwardBatch, RecurrentState
from armillary.kernels import ops
from armillary.layers import GatedRMSNorm, ReplicatedLinear, RowParallelLinear, copy_checked
from armillary.layers.collectives import all_reduce
from armillary_nemotron.config import NemotronHArgs
from armillary_nemotron.mamba_shard import MambaInProj, Rows, mamba_shard
from armillary_nemotron.mamba_verify import mamba_verify
from armillary_nemotron.ops.mamba.naive import ssd_chunk_scan_ref


def _rows_loader(rows: list[Rows], full: int, what: str):
    """A weight loader that keeps ``rows`` (start, count) of a checkpoint tensor of ``full`` rows, in order."""
    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> tuple:
        if shard_id is not None:
            raise WeightLoadError(f"{what} takes no shard (got {shard_id!r})")
        if loaded.shape[0] != full:
            raise WeightLoadError(f"{what} expects {full} rows in the checkpoint, it has {tuple(loaded.shape)}")
        mine = loaded if rows == [(0, full)] else torch.cat([loaded[s: s + n] for s, n in rows])
        return copy_checked(param, (), mine, what)
    return load


class Mamba2Mixer(nn.Module):
    """Parameters as in the checkpoint: ``in_proj`` [d_inner + conv_dim + H, hidden] (rows z | x ‖ B ‖ C | dt),
    ``conv1d.weight`` [conv_dim, 1, K] (+ ``conv1d.bias``), ``A_log``, ``D``, ``dt_bias`` [H] float32,
    ``norm.weight`` [d_inner], ``out_proj``. Under tensor parallelism H, d_inner, conv_dim and n_groups are this
    rank's (``mamba_shard``): in_proj is column-parallel over its five slots, the loaders of the conv and the
    per-head tensors keep this rank's channels of the checkpoint's whole tensors, out_proj is row-parallel
    (the mixer's one all-reduce; a norm group spanning ranks adds a small one for its statistics)."""

    def __init__(self, cfg: NemotronHArgs, prefix: str = "") -> None:
        super().__init__()
        self.shard = shard = mamba_shard(cfg)
        self.heads, self.head_dim = shard.heads, shard.head_dim
        self.groups, self.state_size = shard.groups, shard.state_size
        self.d_inner, self.conv_dim = shard.d_inner, shard.conv_dim
        self.chunk_size, self.dt_min = cfg.chunk_size, cfg.dt_min
        self.tp_size = shard.tp_size
        if shard.norm_across_ranks and torch.get_default_device().type == "cuda":
            # the fused decode / verify kernels norm whole groups of a rank's channels; a cross-rank sum is CPU-only
            raise NotImplementedError(f"n_groups {cfg.n_groups} < tensor-parallel size {shard.tp_size}: a Mamba norm "
                                      "group would span ranks, which the CUDA kernels do not do yet; use a "
                                      f"tensor-parallel size that divides n_groups ({cfg.n_groups})")
        out = self.d_inner + self.conv_dim + self.heads
        # one rank keeps the one-slot layer: a block-scaled checkpoint's scale rows need not fall on slot edges
        self.in_proj = ReplicatedLinear(cfg.hidden_size, out, bias=cfg.mamba_proj_bias, prefix=f"{prefix}.in_proj") \
            if shard.tp_size == 1 else MambaInProj(cfg.hidden_size, shard, cfg.mamba_proj_bias, f"{prefix}.in_proj")
        self.conv1d = skip_init(nn.Conv1d, self.conv_dim, self.conv_dim, cfg.conv_kernel, groups=self.conv_dim,
                                bias=cfg.conv_bias, device=torch.get_default_device())
        # the SSM parameters stay float32 whatever the model dtype
        self.A_log = nn.Parameter(torch.empty(self.heads, dtype=torch.float32), requires_grad=False)
        self.D = nn.Parameter(torch.empty(self.heads, dtype=torch.float32), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.heads, dtype=torch.float32), requires_grad=False)
        self.norm = GatedRMSNorm(self.d_inner, cfg.eps, group_size=min(shard.norm_group_size, self.d_inner),
                                 norm_before_gate=False)
        self.out_proj = RowParallelLinear(cfg.d_inner, cfg.hidden_size, bias=cfg.mamba_proj_bias,
                                          prefix=f"{prefix}.out_proj")
        conv_rows = shard.conv_channels()
        head_rows = [(shard.head_start, self.heads)]
        self.conv1d.weight.weight_loader = _rows_loader(conv_rows, cfg.conv_dim, "conv1d.weight")
        if self.conv1d.bias is not None:
            self.conv1d.bias.weight_loader = _rows_loader(conv_rows, cfg.conv_dim, "conv1d.bias")
        for name in ("A_log", "D", "dt_bias"):
            getattr(self, name).weight_loader = _rows_loader(head_rows, cfg.mamba_heads, name)
        self.norm.weight.weight_loader = _rows_loader([(shard.head_start * self.head_dim, self.d_inner)],
                                                      cfg.d_inner, "norm.weight")

    def gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """norm(y · silu(z)) · w per norm group (d_inner / n_groups channels) -> [T, d_inner] in y's dtype.

        A group that spans ranks (n_groups < tensor-parallel size) takes its sum of squares over them: each
        rank writes its part into its group's column of a [T, n_groups] tensor, summed over the ranks."""
        if not self.shard.norm_across_ranks:
            return self.norm(y, z.contiguous())  # the reference wants z contiguous
        gated = y.float() * F.silu(z.float())
        sums = torch.zeros(y.shape[0], self.shard.total_groups, dtype=torch.float32, device=y.device)
        group = self.shard.group_start
        sums[:, group] = gated.pow(2).sum(-1)
        all_reduce(sums, self.tp_size)
        inv = torch.rsqrt(sums[:, group: group + 1] / self.shard.norm_group_size + self.norm.eps)
        return (gated * inv * self.norm.weight.float()).to(y.dtype)

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
        if fast and batch.is_decode_only and not self.shard.norm_across_ranks:  # conv, state, norm: one launch
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
            if self.shard.norm_across_ranks:
                return self.out_proj(self.gated_norm(y, z))
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
        y = self.gated_norm(y, z)  # norm(y · silu(z)) · w per group of d_inner / n_groups channels
        return self.out_proj(y.to(x.dtype))
