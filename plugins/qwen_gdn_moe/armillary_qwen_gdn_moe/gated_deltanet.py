"""Gated DeltaNet token mixer (the linear-attention layers of Qwen3-Next / Qwen3.5).

x -> in_proj -> [q ‖ k ‖ v | z | b | a]; causal depthwise conv + SiLU over q ‖ k ‖ v (continuing
from the slot's conv state); beta = sigmoid(b), g = -exp(A_log) · softplus(a + dt_bias); the gated
delta rule over L2-normalised q, k (chunked for prefill chunks, recurrent for single-token
decodes), continuing from and writing back the slot's fp32 state; x̂ · w · silu(z); out_proj.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init

from armillary.errors import WeightLoadError
from armillary.forward_batch import ForwardBatch, RecurrentState
from armillary.kernels import ops
from armillary.layers import GatedRMSNorm, MergedColumnParallelLinear, RowParallelLinear, copy_checked
from armillary.parallel import get_parallel
from armillary_qwen_gdn_moe.config import QwenHybridConfig
from armillary_qwen_gdn_moe.ops.gated_delta_rule import chunk_gated_delta_rule_ref, recurrent_gated_delta_rule_ref
from armillary_qwen_gdn_moe.state_snapshots import conv_windows, split_chunks, two_pass


IN_PROJ_SHARDS = ("q", "k", "v", "z", "b", "a")  # the slots of ``in_proj``, in row order


def local_heads(cfg: QwenHybridConfig) -> tuple[int, int]:
    """(key heads, value heads) of the linear attention this tensor-parallel rank holds (all at size 1)."""
    par = get_parallel()
    return (par.shard(cfg.linear_num_key_heads, "linear-attention key heads")[1],
            par.shard(cfg.linear_num_value_heads, "linear-attention value heads")[1])


class GatedDeltaNet(nn.Module):
    """Parameters: ``in_proj`` rows [q | k | v | z | b | a] (a ``MergedColumnParallelLinear``, heads
    in order; ``checkpoint_pieces`` rearranges both checkpoint layouts into it), ``conv1d.weight``
    [C, 1, K], ``A_log`` and ``dt_bias`` [HV] float32, ``norm.weight`` [V], ``out_proj``. Under tensor
    parallelism every head count, C and the states are this rank's (its key heads and their value heads);
    the conv and decay loaders keep the rank's channels of the checkpoint's whole tensors."""

    def __init__(self, cfg: QwenHybridConfig, prefix: str = "") -> None:
        super().__init__()
        self.tp_rank = get_parallel().tp_rank
        self.total_k_heads, self.total_v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.num_k_heads, self.num_v_heads = local_heads(cfg)
        self.head_k_dim = cfg.linear_key_head_dim
        self.head_v_dim = cfg.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.activation = cfg.hidden_act
        full_k, full_v = self.total_k_heads * self.head_k_dim, self.total_v_heads * self.head_v_dim
        self.in_proj_sizes = [full_k, full_k, full_v, full_v, self.total_v_heads,
                              self.total_v_heads]  # the checkpoint's rows of IN_PROJ_SHARDS
        self.in_proj = MergedColumnParallelLinear(cfg.hidden_size, self.in_proj_sizes, prefix=f"{prefix}.in_proj")
        self.conv1d = skip_init(
            nn.Conv1d, self.conv_dim, self.conv_dim, cfg.conv_kernel, groups=self.conv_dim, bias=False,
            device=torch.get_default_device(),
        )
        self.conv1d.weight.weight_loader = self._load_conv
        # the decay parameters stay float32 whatever the model dtype
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads, dtype=torch.float32), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads, dtype=torch.float32), requires_grad=False)
        for param in (self.A_log, self.dt_bias):
            param.weight_loader = self._load_heads
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = RowParallelLinear(full_v, cfg.hidden_size, prefix=f"{prefix}.out_proj")

    def _load_conv(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> tuple:
        """The checkpoint's ``conv1d.weight`` [C_full, 1, K] -> this rank's q, k and v channels."""
        if shard_id is not None:
            raise WeightLoadError(f"conv1d.weight takes no shard (got {shard_id!r})")
        full_k = self.total_k_heads * self.head_k_dim
        r = self.tp_rank
        if loaded.shape[0] != 2 * full_k + self.total_v_heads * self.head_v_dim:
            raise WeightLoadError(f"conv1d.weight has {loaded.shape[0]} channels, expected "
                                  f"{2 * full_k + self.total_v_heads * self.head_v_dim}")
        mine = torch.cat([loaded[start + r * n: start + (r + 1) * n] for start, n in
                          ((0, self.key_dim), (full_k, self.key_dim), (2 * full_k, self.value_dim))])
        return copy_checked(param, (), mine, "conv1d.weight")

    def _load_heads(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> tuple:
        """A per-value-head checkpoint tensor ([HV_full]) -> this rank's value heads."""
        if shard_id is not None:
            raise WeightLoadError(f"a per-head decay parameter takes no shard (got {shard_id!r})")
        n = self.num_v_heads
        return copy_checked(param, (), loaded[self.tp_rank * n: (self.tp_rank + 1) * n], "A_log / dt_bias")

    def checkpoint_pieces(self, local_name: str, tensor: torch.Tensor) -> list | None:
        """Both checkpoint layouts of the input projection -> slots of ``in_proj`` (names relative to
        this module): Qwen3.5's ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``, and
        Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba``, whose rows are grouped per key head:
        [q | k | v×r | z×r] and [b×r | a×r], r = HV / H."""
        part = local_name.removeprefix("in_proj_").removesuffix(".weight")
        if not local_name.startswith("in_proj_") or not local_name.endswith(".weight") or \
                part not in ("qkvz", "ba", "qkv", "z", "b", "a"):
            return None
        hidden = tensor.shape[-1]
        if part in ("qkvz", "ba"):
            groups, ratio = self.total_k_heads, self.total_v_heads // self.total_k_heads
            if part == "qkvz":
                sizes = [self.head_k_dim, self.head_k_dim, ratio * self.head_v_dim, ratio * self.head_v_dim]
            else:
                sizes = [ratio, ratio]
            names = list(part)
            if tensor.shape[0] != groups * sum(sizes):
                raise WeightLoadError(f"{local_name} has {tensor.shape[0]} rows, expected {groups * sum(sizes)}")
            split = tensor.reshape(groups, sum(sizes), hidden).split(sizes, dim=1)  # per key head
            values = [s.reshape(-1, hidden) for s in split]
        else:
            names = list(part)
            sizes = [self.in_proj_sizes[IN_PROJ_SHARDS.index(n)] for n in names]
            if tensor.shape[0] != sum(sizes):
                raise WeightLoadError(f"{local_name} has {tensor.shape[0]} rows, expected {sum(sizes)}")
            values = list(tensor.split(sizes, dim=0))
        return [("in_proj.weight", v, {"shard_id": IN_PROJ_SHARDS.index(n)}) for n, v in zip(names, values)]

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: RecurrentState) -> torch.Tensor:
        """x: [T, H] -> [T, H]; updates this layer's conv and SSM states of ``batch.state_slots``."""
        num_tokens = x.shape[0]
        conv_states, ssm_states = cache.tensors
        projected = self.in_proj(x)  # [T, conv_dim + value_dim + 2 HV]
        fast = ops.use_triton(x)
        if batch.spec_state_rows is not None:
            return self.out_proj(self._verify(projected, batch, conv_states, ssm_states, fast))
        if fast and batch.is_decode_only:
            from armillary_qwen_gdn_moe.ops.gated_delta_rule.fused_recurrent import fused_gdn_decode

            core = fused_gdn_decode(projected, self.conv1d.weight[:, 0], conv_states, ssm_states, self.A_log,
                                    self.dt_bias, self.norm.weight, self.norm.eps, batch.state_slots,
                                    self.num_k_heads, self.head_k_dim, self.head_v_dim)
            return self.out_proj(core)
        mixed_qkv, z, b, a = projected.split(
            [self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads], dim=-1
        )
        snaps = batch.state_snapshots
        if snaps:  # the windows before this step: the conv overwrites the slots
            split = split_chunks(batch.query_start_loc_cpu, snaps, x.device)
            conv_before = conv_states[batch.state_slots[split.snap_seqs]]
            conv_inputs = mixed_qkv
        mixed_qkv = ops.causal_conv1d(mixed_qkv, self.conv1d.weight[:, 0], None, conv_states, batch.state_slots,
                                      batch, activation=self.activation)  # [T, conv_dim]
        q, k, v = mixed_qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(num_tokens, self.num_k_heads, self.head_k_dim)
        k = k.reshape(num_tokens, self.num_k_heads, self.head_k_dim)
        v = v.reshape(num_tokens, self.num_v_heads, self.head_v_dim)
        if fast:
            from armillary_qwen_gdn_moe.ops.gated_delta_rule.gates import gdn_gates

            beta, g = gdn_gates(b, a, self.A_log, self.dt_bias)  # [T, HV] each, g the log decay
        else:
            beta = torch.sigmoid(b)
            g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())  # [T, HV] log decay

        def rule(rows: torch.Tensor | None, cu: list[int], cu_dev: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
            """The delta rule over ``rows`` of the step (None: all) from and into ``slots``: [rows, HV, V]."""
            qr, kr, vr, gr, br = (t if rows is None else t.index_select(0, rows) for t in (q, k, v, g, beta))
            if fast:
                from armillary_qwen_gdn_moe.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_slots

                return chunk_gated_delta_rule_slots(qr, kr, vr, gr, br, cu_dev, ssm_states, slots, cu_seqlens_cpu=cu)
            return self._delta_rule(qr, kr, vr, gr, br, cu, slots, ssm_states)

        if snaps:  # checkpoints inside the chunk: two passes, the state saved between them
            conv_states[split.snap_rows] = conv_windows(conv_before, conv_inputs, batch.query_start_loc_cpu, snaps)
            core = two_pass(rule, split, num_tokens, batch.state_slots, ssm_states, v)
        else:
            core = rule(None, batch.query_start_loc_cpu, batch.query_start_loc, batch.state_slots)  # [T, HV, V]
        core = self.norm(core, z.reshape(num_tokens, self.num_v_heads, self.head_v_dim))
        return self.out_proj(core.reshape(num_tokens, self.value_dim))

    def _verify(self, projected: torch.Tensor, batch: ForwardBatch, conv_states: torch.Tensor,
                ssm_states: torch.Tensor, fast: bool) -> torch.Tensor:
        """A verify step: every sequence has K + 1 tokens; position i < K reads the state after
        position i - 1 and writes its own to ``spec_state_rows[:, i]``, the last writes the slot,
        so the state after any accepted prefix survives. -> [T, value_dim]."""
        rows = batch.spec_state_rows  # [B, K]
        num, k = rows.shape
        if fast:  # one launch over every position, the state kept in registers between them
            from armillary_qwen_gdn_moe.ops.gated_delta_rule.fused_verify import fused_gdn_verify

            return fused_gdn_verify(projected, self.conv1d.weight[:, 0], conv_states, ssm_states, self.A_log,
                                    self.dt_bias, self.norm.weight, self.norm.eps, batch.state_slots,
                                    rows.contiguous(), self.num_k_heads, self.head_k_dim, self.head_v_dim)
        steps = projected.view(num, k + 1, -1)  # [B, K+1, P]
        outs = []
        for i in range(k + 1):
            src = batch.state_slots if i == 0 else rows[:, i - 1].contiguous()  # the kernel reads unit-stride rows
            dst = rows[:, i].contiguous() if i < k else batch.state_slots
            outs.append(self._decode_reference(steps[:, i].contiguous(), src, dst, conv_states, ssm_states))
        return torch.stack(outs, dim=1).reshape(num * (k + 1), self.value_dim)

    def _decode_reference(self, mixed: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
                          conv_states: torch.Tensor, ssm_states: torch.Tensor) -> torch.Tensor:
        """One token per sequence in plain torch, reading states ``src`` and writing ``dst``: [B, value_dim]."""
        num = mixed.shape[0]
        mixed_qkv, z, b, a = mixed.split([self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads], dim=-1)
        window = torch.cat([conv_states[src], mixed_qkv[:, :, None].to(conv_states.dtype)], dim=2)  # [B, C, KW]
        conv = (window.float() * self.conv1d.weight[:, 0].float()).sum(-1)
        conv_states[dst] = window[:, :, 1:]
        conv = F.silu(conv).to(mixed.dtype)  # [B, C]
        q, k, v = conv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(num, self.num_k_heads, self.head_k_dim)
        k = k.reshape(num, self.num_k_heads, self.head_k_dim)
        v = v.reshape(num, self.num_v_heads, self.head_v_dim)
        beta = torch.sigmoid(b)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        o, final = recurrent_gated_delta_rule_ref(q, k, v, g, beta, list(range(num + 1)), initial_state=ssm_states[src])
        ssm_states[dst] = final.to(ssm_states.dtype)
        core = self.norm(o, z.reshape(num, self.num_v_heads, self.head_v_dim))
        return core.reshape(num, self.value_dim)

    @staticmethod
    def _delta_rule(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        bounds: list[int],
        state_slots: torch.Tensor,
        ssm_states: torch.Tensor,
    ) -> torch.Tensor:
        """Decodes (one new token) take the recurrent step, longer chunks the chunked form (``bounds``:
        host cu_seqlens of the packed rows, ``state_slots`` [B] their sequences' slots)."""
        lengths = [bounds[i + 1] - bounds[i] for i in range(len(bounds) - 1)]
        out = torch.empty_like(v)
        groups = (
            ([i for i, n in enumerate(lengths) if n == 1], recurrent_gated_delta_rule_ref),
            ([i for i, n in enumerate(lengths) if n > 1], chunk_gated_delta_rule_ref),
        )
        for seqs, rule in groups:
            if not seqs:
                continue
            tokens = torch.cat([torch.arange(bounds[i], bounds[i + 1]) for i in seqs]).to(v.device)
            cu_seqlens = [0]
            for i in seqs:
                cu_seqlens.append(cu_seqlens[-1] + lengths[i])
            slots = state_slots[torch.tensor(seqs, device=state_slots.device)]
            o, final = rule(
                q[tokens], k[tokens], v[tokens], g[tokens], beta[tokens], cu_seqlens,
                initial_state=ssm_states[slots],
            )
            out[tokens] = o
            ssm_states[slots] = final.to(ssm_states.dtype)
        return out
