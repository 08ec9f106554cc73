"""The MoE experts layer: stacked experts (plus optional shared ones), their weight loaders and the EP expert map.

Routing stays with the model (Qwen: softmax top-k; Nemotron / GLM: sigmoid + correction bias; all
in ``ops``): it hands ``forward`` the chosen experts and their weights, and ``FusedMoE`` runs them
through its ``FusedMoEMethod`` (unquantized: ``ops.fused_moe``).
"""
from __future__ import annotations

import re

import torch
from torch import nn

from armillary.errors import WeightLoadError
from armillary.layers.collectives import all_reduce
from armillary.layers.loading import Index, copy_checked
from armillary.layers.quantization.base import QuantConfig
from armillary.layers.quantization.context import get_quant_config
from armillary.parallel import get_parallel

_PER_EXPERT = re.compile(r"^(?P<e>\d+)\.(?P<proj>[A-Za-z0-9_]+)\.(?P<attr>.+)$")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class FusedMoE(nn.Module):
    """``num_experts`` routed experts (+ ``num_shared`` always-on experts of the same width,
    stored after them as experts ``num_experts ..``; the router gives them ids and weights like
    any other, e.g. ``ops.softmax_topk_with_shared``), each ``hidden -> intermediate -> hidden``.

    Parameters (unquantized; a ``FusedMoEMethod`` may add ``gate_up_proj_<attr>`` /
    ``down_proj_<attr>`` tensors):
    ``gate_up_proj`` [E_local, 2I, H] rows [gate | up] (``gated=False``: [E_local, I, H], up only),
    ``down_proj`` [E_local, H, I]; I = intermediate_size / tp_size (whole at ep_size > 1: expert
    parallelism splits experts, not their width, so ``tp_size`` is then 1 here), E_local = the experts
    this rank holds (``local_experts``, global ids; all of them at ep_size 1).

    ``weight_loader(param, loaded, shard_id=None, expert_id=None)``:

    - per expert: ``expert_id`` (global id, shared experts included) with ``shard_id`` "gate" /
      "up" ([I_full, H] into ``gate_up_proj``), "down" ([H, I_full] into ``down_proj``) or None
      (an expert's stacked [2I_full, H] ``gate_up_proj`` or its ``down_proj``). Experts another
      EP rank holds are skipped (returns None).
    - stacked: ``expert_id=None``: a checkpoint tensor of every routed expert ([E, 2I, H] /
      [E, H, I], transformers' fused ``experts.gate_up_proj`` / ``experts.down_proj``) or of
      routed and shared experts ([E + S, ...]).

    ``checkpoint_pieces`` maps per-expert checkpoint names relative to this module,
    ``<e>.gate_proj.<attr>`` / ``<e>.up_proj.<attr>`` / ``<e>.down_proj.<attr>`` (the names in
    ``checkpoint_names``), onto those loaders.

    ``forward(x [T, H], topk_weights [T, k] float32, topk_ids [T, k] global ids) -> [T, H]``,
    summed over tensor- and expert-parallel ranks unless ``reduce_results`` is False. With
    ep_size > 1 the pairs of experts held elsewhere get weight 0 here.
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 activation: str = "silu", num_shared: int = 0, *, gated: bool = True, reduce_results: bool = True,
                 checkpoint_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                 quant_config: QuantConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        par = get_parallel()
        self.ep_rank, self.ep_size = par.ep_rank, par.ep_size
        # expert parallelism splits whole experts over the ranks, never their width as well
        self.tp_rank, self.tp_size = (0, 1) if self.ep_size > 1 else (par.tp_rank, par.tp_size)
        if num_experts % self.ep_size:
            raise ValueError(f"{num_experts} experts do not split over expert-parallel size {self.ep_size}")
        self.num_experts, self.num_shared, self.top_k = num_experts, num_shared, top_k
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.activation, self.gated, self.reduce_results, self.prefix = activation, gated, reduce_results, prefix
        self.checkpoint_names = dict(zip(checkpoint_names, ("gate", "up", "down")))
        per_rank = num_experts // self.ep_size
        routed = list(range(self.ep_rank * per_rank, (self.ep_rank + 1) * per_rank))
        shared = list(range(num_experts, num_experts + num_shared)) if self.ep_rank == 0 else []
        self.local_experts = routed + shared  # global ids, in parameter order
        self._local = {g: i for i, g in enumerate(self.local_experts)}
        expert_map = torch.full((num_experts + num_shared,), -1, dtype=torch.int32)
        expert_map[torch.tensor(self.local_experts, dtype=torch.long)] = torch.arange(len(self.local_experts),
                                                                                      dtype=torch.int32)
        self.register_buffer("expert_map", expert_map, persistent=False)  # global id -> local id, -1 elsewhere
        self.intermediate_size_per_partition = intermediate_size if self.tp_size == 1 else \
            par.shard(intermediate_size, f"intermediate size of {prefix}")[1]
        self.quant_method = (quant_config or get_quant_config()).moe_method(self, prefix)
        self.quant_method.create_weights(self, len(self.local_experts), hidden_size,
                                         self.intermediate_size_per_partition, torch.get_default_dtype())

    def shared_expert_id(self, i: int = 0) -> int:
        """Global id of shared expert ``i``."""
        return self.num_experts + i

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if self.ep_size > 1:
            local = self.expert_map[topk_ids]  # [T, k], -1 where another rank holds the expert
            topk_weights = torch.where(local >= 0, topk_weights, torch.zeros_like(topk_weights))
            topk_ids = local.clamp(min=0)
        out = self.quant_method.apply(self, x, topk_weights, topk_ids)
        if self.reduce_results:
            all_reduce(out, self.tp_size, "tp")
            all_reduce(out, self.ep_size, "ep")
        return out

    # ---- loading

    def checkpoint_pieces(self, local_name: str, tensor: torch.Tensor) -> list | None:
        """``<e>.<proj>.<attr>`` -> (``gate_up_proj`` / ``down_proj`` [+ ``_<attr>``], shard, expert e)."""
        m = _PER_EXPERT.match(local_name)
        if m is None or m["proj"] not in self.checkpoint_names or int(m["e"]) >= self.num_experts:
            return None
        shard = self.checkpoint_names[m["proj"]]
        base = "down_proj" if shard == "down" else "gate_up_proj"
        param = base if m["attr"] == "weight" else f"{base}_{m['attr']}"
        return [(param, tensor, {"shard_id": shard, "expert_id": int(m["e"])})]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None,
                      expert_id: int | None = None) -> Index | None:
        """See the class docstring; returns the index written into ``param`` (None: not this rank's)."""
        what = self._what(param)
        if expert_id is not None:
            return self._load_expert(param, loaded, shard_id, expert_id, what)
        if loaded.shape[0] not in (self.num_experts, self.num_experts + self.num_shared):
            raise WeightLoadError(f"{what}: a stacked checkpoint tensor needs {self.num_experts} (or "
                                  f"{self.num_experts + self.num_shared}) experts, got shape {tuple(loaded.shape)}")
        written = [(e, self._load_expert(param, loaded[e], shard_id, e, what)) for e in range(loaded.shape[0])]
        mine = [(self._local[e], index) for e, index in written if index is not None]
        if not mine:
            return None
        first, last = mine[0][0], mine[-1][0]  # this rank's experts are consecutive local ids
        return (slice(first, last + 1),) + tuple(mine[0][1][1:])

    def _load_expert(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None, expert_id: int,
                     what: str) -> Index | None:
        if not 0 <= expert_id < self.num_experts + self.num_shared:
            raise WeightLoadError(f"{what}: expert {expert_id} is outside the {self.num_experts} routed + "
                                  f"{self.num_shared} shared experts")
        local = self._local.get(expert_id)
        if local is None:
            return None  # held by another expert-parallel rank
        is_w13 = self._param_name(param).startswith("gate_up_proj")
        shards = ("gate", "up") if self.gated else ("up",)
        allowed = shards if is_w13 else ("down",)
        if shard_id is not None and shard_id not in allowed:
            raise WeightLoadError(f"{what}: shard_id must be one of {allowed} or None, not {shard_id!r}")
        if getattr(param, "per_shard", False) and is_w13:
            if shard_id is None:
                return copy_checked(param, (local,), loaded.reshape(param.shape[1:]), what)
            k = shards.index(shard_id)
            return copy_checked(param, (local, k), loaded.reshape(param.shape[2:]), what)
        dim = getattr(param, "moe_dim", None)
        if dim is None:
            return copy_checked(param, (local,), loaded, what)  # one value (or row) per expert
        block = getattr(param, "moe_block", 1)
        rows = self.intermediate_size_per_partition
        count, src = _cdiv(rows, block), self.tp_rank * rows // block
        full = _cdiv(self.intermediate_size, block)
        picked = allowed if (shard_id is None and is_w13) else (shard_id or "down",)
        expected = list(param.shape[1:])
        expected[dim - 1] = full * len(picked)
        if list(loaded.shape) != expected:
            raise WeightLoadError(f"{what}: expects a checkpoint tensor of shape {tuple(expected)} for expert "
                                  f"{expert_id}{'' if shard_id is None else ' ' + shard_id}, got {tuple(loaded.shape)}")
        index: Index = (local,)
        for i, shard in enumerate(picked):
            dst = shards.index(shard) * count if is_w13 else 0
            part = loaded.narrow(dim - 1, i * full + src, count)
            sub: list = [slice(None)] * (dim + 1)
            sub[0], sub[dim] = local, slice(dst, dst + count)
            index = copy_checked(param, tuple(sub), part, what)
        if len(picked) > 1 or not is_w13:
            return (local,)  # whole rows of this expert
        return index

    def _param_name(self, param: nn.Parameter) -> str:
        return next((n for n, p in self.named_parameters(recurse=False) if p is param), "")

    def _what(self, param: nn.Parameter) -> str:
        return f"{self.prefix or type(self).__name__}.{self._param_name(param) or '?'}"

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}+{self.num_shared} (local {len(self.local_experts)}), top_k={self.top_k}, "
                f"hidden={self.hidden_size}, intermediate={self.intermediate_size_per_partition}/"
                f"{self.intermediate_size}, method={type(self.quant_method).__name__}")
