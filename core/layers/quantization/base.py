"""The quantization contract: a ``QuantConfig`` per checkpoint format hands each layer the method that owns its weights.

A linear or MoE layer never creates its weight tensors itself. At construction it asks the
build-time ``QuantConfig`` (``armillary.layers.quantization.get_quant_config()``) for a method,
lets the method register the parameters (and so the checkpoint tensors) it needs, and calls the
method's ``apply`` in ``forward``. A new checkpoint format is therefore one ``QuantConfig`` with
its methods, registered through ``armillary_register_quantizations``, and no change to any model.

How a parameter is loaded is said by attributes on it (``register_weight``); the layer's own
``weight_loader`` reads them to cut a checkpoint tensor into this rank's rows / columns and stack
it into the right slot, so a method states *what* it stores and never *how* it is sharded.
"""
from __future__ import annotations

import re
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch
from torch import nn

# attributes register_weight sets on a parameter, and what the layers' weight loaders read from them
WEIGHT_ATTRS = ("output_dim", "input_dim", "output_block", "input_block", "per_shard", "moe_dim", "moe_block")


def register_weight(layer: nn.Module, name: str, data: torch.Tensor, *, output_dim: int | None = None,
                    input_dim: int | None = None, output_block: int = 1, input_block: int = 1,
                    per_shard: bool = False, moe_dim: int | None = None, moe_block: int = 1) -> nn.Parameter:
    """Register ``data`` (uninitialised, this rank's shape) as parameter ``name`` of ``layer``.

    The attributes tell ``layer.weight_loader`` how a checkpoint tensor maps onto the parameter:

    - linear layers: ``output_dim`` / ``input_dim`` — which dimension runs along the layer's output
      rows / input columns (None: neither; the tensor is copied whole). ``output_block`` /
      ``input_block`` — how many logical rows / columns one element covers along that dimension
      (1 for weights; 128 for a 128x128 block scale; 2 for two 4-bit values packed in a byte).
      ``per_shard`` — dimension 0 has one entry per stacked shard (e.g. one per-tensor scale each
      for q, k and v of a ``QKVParallelLinear``; shape [1] on an unstacked layer).
    - ``FusedMoE``: dimension 0 is always the (local) expert. ``moe_dim`` — the dimension running
      along the intermediate size (rows [gate | up] of ``gate_up_proj``, columns of
      ``down_proj``), sharded over tensor parallelism; ``moe_block`` as ``output_block``.
      ``per_shard``: dimension 1 has one entry per shard (gate, up) of ``gate_up_proj``.

    The parameter gets ``weight_loader = layer.weight_loader`` and ``requires_grad=False``.
    """
    param = nn.Parameter(data, requires_grad=False)
    attrs = dict(output_dim=output_dim, input_dim=input_dim, output_block=output_block, input_block=input_block,
                 per_shard=per_shard, moe_dim=moe_dim, moe_block=moe_block)
    for key, value in attrs.items():
        setattr(param, key, value)
    param.weight_loader = layer.weight_loader
    layer.register_parameter(name, param)
    return param


def per_tensor_scale_loader(base):
    """Wrap a per-tensor fp32 scale's weight loader: a stored [] or [1] value is shaped to the parameter's
    entry (a per-shard slot, or an expert's entry of an [E, 1] parameter) and read as fp32."""

    def load(param: nn.Parameter, loaded: torch.Tensor, *args, **kwargs):
        if loaded.numel() == 1:
            expert_entry = param.dim() == 2 and kwargs.get("expert_id") is not None  # [E, 1]: one value per expert
            loaded = loaded.reshape(1) if expert_entry else loaded.reshape(())
        return base(param, loaded.float(), *args, **kwargs)

    return load


class QuantMethod(ABC):
    """How one linear layer stores its weight and computes ``y = x W^T + b``.

    Contract:

    - ``create_weights`` is called once from the layer's constructor, on the default device and
      dtype of the model being built. It registers every parameter the format stores (at least
      ``weight``; e.g. also ``weight_scale``) through ``register_weight``, with this rank's
      shapes: ``input_size_per_partition`` columns and ``sum(output_partition_sizes)`` rows, the
      rows stacked in the order of ``output_partition_sizes`` (one entry per stacked shard: q, k,
      v or gate, up). Parameter names are the checkpoint's tensor names relative to the layer, so
      ``<layer>.weight_scale`` in the checkpoint lands in ``layer.weight_scale``. The tensors are
      left uninitialised: the checkpoint fills them.
    - The layer, not the method, owns ``bias`` (created in the params dtype, never quantized).
    - ``process_weights_after_loading`` is called once after every checkpoint tensor is loaded,
      before the first forward and before any CUDA graph is captured: repack, transpose, fold
      scales, or replace parameters with the layout the kernel wants. Default: nothing.
    - ``apply`` computes the layer's output for x ``[..., input_size_per_partition]`` ->
      ``[..., sum(output_partition_sizes)]`` in x's dtype, adding ``bias`` when given. It must be
      capturable in a CUDA graph (no host syncs, no allocation that depends on values).
    """

    @abstractmethod
    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype) -> None:
        """Register this format's parameters on ``layer`` (see the class contract)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W^T + bias`` with ``layer``'s parameters."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Once, after loading: bring the loaded tensors into the kernel's layout."""


class FusedMoEMethod(ABC):
    """How a ``FusedMoE`` layer stores its stacked experts and runs them.

    Contract:

    - ``create_weights`` registers, through ``register_weight`` with ``moe_dim`` set, at least
      ``gate_up_proj`` [E, 2I, H] (rows [gate | up]; [E, I, H] when ``layer.gated`` is False) and
      ``down_proj`` [E, H, I], where E = ``num_experts`` is the number of experts this rank holds
      and I = ``intermediate_size_per_partition``. Further tensors are named
      ``gate_up_proj_<attr>`` / ``down_proj_<attr>`` for checkpoint tensors
      ``experts.<e>.{gate,up}_proj.<attr>`` / ``experts.<e>.down_proj.<attr>`` (e.g.
      ``down_proj_weight_scale``), so the layer's per-expert name mapping finds them.
    - ``process_weights_after_loading`` as for ``QuantMethod``.
    - ``apply(layer, x [T, H], topk_weights [T, k] float32, topk_ids [T, k] local expert ids)``
      returns ``sum_j topk_weights[:, j] · expert_{topk_ids[:, j]}(x)`` as [T, H] in x's dtype,
      with ``layer.activation`` (``act(gate) · up``, or ``act(up)`` when not gated); the sum over
      tensor-parallel ranks is the layer's job. Capturable in a CUDA graph.
    """

    @abstractmethod
    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype) -> None:
        """Register the stacked expert parameters on ``layer`` (see the class contract)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum for each token."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Once, after loading: bring the loaded tensors into the kernel's layout."""


class QuantConfig(ABC):
    """One checkpoint format, read from ``config.json``'s ``quantization_config``.

    Contract:

    - ``name`` is the ``quant_method`` value it serves and the name it is registered under.
    - ``from_config(quantization_config)`` builds it from that dict (unknown keys are ignored;
      a value it cannot serve is a ``ValueError`` naming the key).
    - ``linear_method(layer, prefix)`` / ``moe_method(layer, prefix)`` return the method for the
      layer being built at module path ``prefix`` (e.g. ``model.layers.0.self_attn.qkv_proj``);
      layers the format leaves unquantized (``modules_to_not_convert``, ``ignore``: see
      ``is_skipped``) get the unquantized methods. A format without MoE support raises
      ``NotImplementedError`` from ``moe_method`` with its name.
    - Instances are immutable once built and shared by every layer of one model.
    """

    name: ClassVar[str]

    def __init__(self, ignore: tuple[str, ...] = ()) -> None:
        self.ignore = tuple(ignore)

    @classmethod
    @abstractmethod
    def from_config(cls, quantization_config: dict[str, Any]) -> QuantConfig:
        """Build from ``config.json``'s ``quantization_config`` dict."""

    @abstractmethod
    def linear_method(self, layer: nn.Module, prefix: str) -> QuantMethod:
        """The method of the linear layer built at ``prefix``."""

    def moe_method(self, layer: nn.Module, prefix: str) -> FusedMoEMethod:
        """The method of the MoE layer built at ``prefix``."""
        raise NotImplementedError(f"quantization {self.name!r} has no MoE method (layer {prefix or '?'})")

    def is_skipped(self, prefix: str) -> bool:
        """Whether ``prefix`` stays unquantized: an ``ignore`` entry equal to it, naming a module
        that contains it (``model.layers.0.mlp`` covers its projections), ending it (``lm_head``),
        or ``re:<regex>`` matching it in full (compressed-tensors' spelling)."""
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.fullmatch(entry[3:], prefix):
                    return True
            elif prefix == entry or prefix.startswith(entry + ".") or prefix.endswith("." + entry):
                return True
        return False
