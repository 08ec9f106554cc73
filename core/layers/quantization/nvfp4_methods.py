"""NVFP4 linear and MoE methods: packed e2m1 weights with fp8 group scales and per-shard global scales, as ModelOpt or compressed-tensors store them.

A layer stores, under the checkpoint's names (``Nvfp4Names``): the packed weight uint8 [N, K / 2]
(``weight`` / ``weight_packed``), ``weight_scale`` float8_e4m3fn [N, K / 16], one global scale
per stacked shard (``weight_scale_2``, multiplied in / ``weight_global_scale``, its reciprocal)
and, for W4A4 checkpoints, one activation scale per shard (``input_scale`` /
``input_global_scale``; kept for a native FP4 path, unused by the weight-only kernels). After
loading, the per-shard global scales become one fp32 scale per output row (``fp4_global_scale``),
so q / k / v or gate / up shards quantized with different global scales stay exact, and a
compressed-tensors ``weight_packed`` is renamed ``weight`` (``gate_up_proj`` / ``down_proj``).
``apply`` calls ``ops.fp4_linear`` / ``ops.fp4_fused_moe`` (``armillary.kernels.fp4`` layout).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from armillary.errors import WeightLoadError
from armillary.kernels import ops
from armillary.kernels.fp4 import FP4_GROUP, FP8_DTYPE, quantize_nvfp4, row_global_scale
from armillary.layers.quantization.base import FusedMoEMethod, QuantMethod, per_tensor_scale_loader, register_weight


@dataclass(frozen=True, slots=True)
class Nvfp4Names:
    """One checkpoint layout's tensor names, relative to the layer."""

    packed: str  # uint8 [N, K / 2]
    global_scale: str  # fp32, one per checkpoint tensor
    global_reciprocal: bool  # the stored global scale divides (compressed-tensors) rather than multiplies
    input_scale: str | None  # fp32 activation scale per checkpoint tensor (None: weight-only checkpoint)


MODELOPT = Nvfp4Names("weight", "weight_scale_2", False, "input_scale")
MODELOPT_W4A16 = Nvfp4Names("weight", "weight_scale_2", False, None)
COMPRESSED_TENSORS = Nvfp4Names("weight_packed", "weight_global_scale", True, "input_global_scale")
COMPRESSED_TENSORS_W4A16 = Nvfp4Names("weight_packed", "weight_global_scale", True, None)


def _checked_loader(owner: nn.Module, base, name: str, dtype: torch.dtype, hint: str):
    """A weight loader that refuses checkpoint tensors of another dtype (a silent cast would be garbage)."""

    def load(param: nn.Parameter, loaded: torch.Tensor, *args, **kwargs):
        if loaded.dtype != dtype:
            raise WeightLoadError(f"{owner.prefix or type(owner).__name__}.{name}: the checkpoint tensor is "
                                  f"{loaded.dtype}, this NVFP4 layer takes {dtype} ({hint})")
        return base(param, loaded, *args, **kwargs)

    return load


_PACKED_HINT = "packed e2m1 pairs; is the module in the checkpoint's exclude_modules / ignore?"
_SCALE_HINT = "e4m3 scales per 16 columns"


def _finite(values: torch.Tensor, what: str) -> None:
    if not bool(torch.isfinite(values).all()):
        raise WeightLoadError(f"{what}: the NVFP4 scales hold non-finite values")


class Nvfp4LinearMethod(QuantMethod):
    """NVFP4 weights of one linear layer in the layout ``names`` (see the module docstring)."""

    def __init__(self, names: Nvfp4Names = MODELOPT) -> None:
        self.names = names

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype) -> None:
        k, n, shards = input_size_per_partition, sum(output_partition_sizes), len(output_partition_sizes)
        if k % FP4_GROUP:
            raise ValueError(f"{layer.prefix or type(layer).__name__}: {k} input columns per rank are not whole "
                             f"NVFP4 groups of {FP4_GROUP}")
        names = self.names
        packed = register_weight(layer, names.packed, torch.empty(n, k // 2, dtype=torch.uint8), output_dim=0,
                                 input_dim=1, input_block=2)
        packed.weight_loader = _checked_loader(layer, packed.weight_loader, names.packed, torch.uint8, _PACKED_HINT)
        scale = register_weight(layer, "weight_scale", torch.empty(n, k // FP4_GROUP, dtype=FP8_DTYPE),
                                output_dim=0, input_dim=1, input_block=FP4_GROUP)
        scale.weight_loader = _checked_loader(layer, scale.weight_loader, "weight_scale", FP8_DTYPE, _SCALE_HINT)
        for name in (names.global_scale, names.input_scale):
            if name is not None:
                p = register_weight(layer, name, torch.empty(shards, dtype=torch.float32), per_shard=True)
                p.weight_loader = per_tensor_scale_loader(p.weight_loader)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        names, what = self.names, layer.prefix or type(layer).__name__
        stored = getattr(layer, names.global_scale).data
        per_shard = stored.reciprocal() if names.global_reciprocal else stored  # [S], multiplied in
        _finite(per_shard, f"{what}.{names.global_scale}")
        sizes = torch.tensor(layer.output_partition_sizes, device=stored.device)
        rows = per_shard.repeat_interleave(sizes)  # [N]: each shard's rows keep their own global scale
        delattr(layer, names.global_scale)
        layer.fp4_global_scale = nn.Parameter(rows.contiguous(), requires_grad=False)
        if names.packed != "weight":
            layer.weight = nn.Parameter(getattr(layer, names.packed).data, requires_grad=False)
            delattr(layer, names.packed)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        lead = x.shape[:-1]
        out = ops.fp4_linear(x.reshape(-1, x.shape[-1]), layer.weight, layer.weight_scale, layer.fp4_global_scale,
                             bias)  # [M, N]
        return out.view(*lead, out.shape[-1])


class Nvfp4MoEMethod(FusedMoEMethod):
    """Stacked NVFP4 experts: ``gate_up_proj`` uint8 [E, 2I, H / 2] and ``down_proj`` [E, H, I / 2] (or
    ``*_weight_packed``), ``*_weight_scale`` e4m3 [E, 2I, H / 16] / [E, H, I / 16], the global scales
    ``gate_up_proj_<global>`` [E, 2, 1] (gate, up) and ``down_proj_<global>`` [E, 1], likewise the
    activation scales; after loading ``gate_up_proj_fp4_global_scale`` [E, 2I] and
    ``down_proj_fp4_global_scale`` [E, H], one per output row."""

    def __init__(self, names: Nvfp4Names = MODELOPT) -> None:
        self.names = names

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype) -> None:
        e, h, inter = num_experts, hidden_size, intermediate_size_per_partition
        if h % FP4_GROUP or inter % FP4_GROUP:
            raise ValueError(f"{layer.prefix or 'FusedMoE'}: hidden {h} and intermediate {inter} per rank must be "
                             f"whole NVFP4 groups of {FP4_GROUP}")
        shards = 2 if layer.gated else 1
        names = self.names
        w13_name, w2_name = ("gate_up_proj", "down_proj") if names.packed == "weight" else \
            (f"gate_up_proj_{names.packed}", f"down_proj_{names.packed}")
        tensors = [
            (w13_name, torch.empty(e, shards * inter, h // 2, dtype=torch.uint8), dict(moe_dim=1), torch.uint8),
            (w2_name, torch.empty(e, h, inter // 2, dtype=torch.uint8), dict(moe_dim=2, moe_block=2), torch.uint8),
            ("gate_up_proj_weight_scale", torch.empty(e, shards * inter, h // FP4_GROUP, dtype=FP8_DTYPE),
             dict(moe_dim=1), FP8_DTYPE),
            ("down_proj_weight_scale", torch.empty(e, h, inter // FP4_GROUP, dtype=FP8_DTYPE),
             dict(moe_dim=2, moe_block=FP4_GROUP), FP8_DTYPE),
        ]
        for name, data, attrs, dtype in tensors:
            p = register_weight(layer, name, data, **attrs)
            hint = _PACKED_HINT if dtype == torch.uint8 else _SCALE_HINT
            p.weight_loader = _checked_loader(layer, p.weight_loader, name, dtype, hint)
        for attr in (names.global_scale, names.input_scale):
            if attr is None:
                continue
            for name, data, attrs in ((f"gate_up_proj_{attr}", torch.empty(e, shards, 1), dict(per_shard=True)),
                                      (f"down_proj_{attr}", torch.empty(e, 1), {})):
                p = register_weight(layer, name, data.float(), **attrs)
                p.weight_loader = per_tensor_scale_loader(p.weight_loader)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        names, what = self.names, layer.prefix or "FusedMoE"
        inter = layer.intermediate_size_per_partition
        for base, rows in (("gate_up_proj", inter), ("down_proj", layer.hidden_size)):
            stored = getattr(layer, f"{base}_{names.global_scale}").data  # [E, 2, 1] or [E, 1]
            per_shard = stored.reciprocal() if names.global_reciprocal else stored
            _finite(per_shard, f"{what}.{base}_{names.global_scale}")
            flat = per_shard.reshape(per_shard.shape[0], -1)  # [E, shards]
            expanded = flat.repeat_interleave(rows, dim=1) if base == "gate_up_proj" else flat.expand(-1, rows)
            delattr(layer, f"{base}_{names.global_scale}")
            setattr(layer, f"{base}_fp4_global_scale", nn.Parameter(expanded.contiguous(), requires_grad=False))
            if names.packed != "weight":
                packed = f"{base}_{names.packed}"
                setattr(layer, base, nn.Parameter(getattr(layer, packed).data, requires_grad=False))
                delattr(layer, packed)

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        return ops.fp4_fused_moe(x, layer.gate_up_proj, layer.gate_up_proj_weight_scale,
                                 layer.gate_up_proj_fp4_global_scale, layer.down_proj, layer.down_proj_weight_scale,
                                 layer.down_proj_fp4_global_scale, topk_weights, topk_ids, layer.activation)


class OnlineNvfp4LinearMethod(Nvfp4LinearMethod):
    """``--quantization nvfp4``: ``weight`` loaded in the params dtype, each stacked shard quantized after
    loading as ModelOpt would export it (``quantize_nvfp4``: its own global scale), then as ``Nvfp4LinearMethod``."""

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype) -> None:
        weight = torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype)
        register_weight(layer, "weight", weight, output_dim=0, input_dim=1)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        parts = [quantize_nvfp4(w) for w in layer.weight.data.split(layer.output_partition_sizes)]
        layer.weight = nn.Parameter(torch.cat([p for p, _, _ in parts]), requires_grad=False)  # [N, K/2]
        layer.weight_scale = nn.Parameter(torch.cat([s for _, s, _ in parts]), requires_grad=False)  # [N, K/16]
        rows = [row_global_scale(g, n) for (_, _, g), n in zip(parts, layer.output_partition_sizes)]
        layer.fp4_global_scale = nn.Parameter(torch.cat(rows), requires_grad=False)  # [N]


class OnlineNvfp4MoEMethod(Nvfp4MoEMethod):
    """``--quantization nvfp4`` experts: loaded in the params dtype, each expert's gate, up and down
    quantized after loading with their own global scales, then as ``Nvfp4MoEMethod``."""

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype) -> None:
        rows = (2 if layer.gated else 1) * intermediate_size_per_partition
        register_weight(layer, "gate_up_proj", torch.empty(num_experts, rows, hidden_size, dtype=params_dtype),
                        moe_dim=1)
        register_weight(layer, "down_proj",
                        torch.empty(num_experts, hidden_size, intermediate_size_per_partition, dtype=params_dtype),
                        moe_dim=2)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        inter = layer.intermediate_size_per_partition
        for base in ("gate_up_proj", "down_proj"):
            full = getattr(layer, base).data
            shards = full.split(inter, dim=1) if base == "gate_up_proj" else (full,)
            parts = [quantize_nvfp4(w) for w in shards]  # globals per expert: [E] each
            setattr(layer, base, nn.Parameter(torch.cat([p for p, _, _ in parts], dim=1), requires_grad=False))
            setattr(layer, f"{base}_weight_scale", nn.Parameter(torch.cat([s for _, s, _ in parts], dim=1),
                                                                requires_grad=False))
            rows = [row_global_scale(g, w.shape[1]) for (_, _, g), w in zip(parts, shards)]  # [E, rows] each
            setattr(layer, f"{base}_fp4_global_scale", nn.Parameter(torch.cat(rows, dim=1), requires_grad=False))
