"""``quant_method: compressed-tensors`` FP8 as llm-compressor / RedHatAI publish: per-channel (FP8_DYNAMIC) or block weights, dynamic activations.

``config_groups.<g> = {targets: ["Linear" | "re:<regex>"], weights: {num_bits: 8, type: float,
strategy: channel | block, block_structure: [bn, bk]}, input_activations: {num_bits: 8, type:
float, dynamic: true, strategy: token | group}}``; ``ignore`` lists modules left in bf16. Tensors:
``X.weight`` float8_e4m3fn, ``X.weight_scale`` fp32 ``[out, 1]`` (channel) or ``[ceil(out / bn),
ceil(in / bk)]`` (block). Activations are quantized per token and group of 128 at run time either
way (at least as fine as the checkpoint asks).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from torch import nn

from armillary.layers.quantization.base import FusedMoEMethod, QuantConfig, QuantMethod
from armillary.layers.quantization.fp8 import skipped
from armillary.layers.quantization.fp8_methods import Fp8LinearMethod, Fp8MoEMethod
from armillary.layers.quantization.unquantized import UnquantizedFusedMoEMethod, UnquantizedLinearMethod


@dataclass(frozen=True, slots=True)
class SchemeGroup:
    """One config group: the modules it targets and its weight block ((1, None): per output channel)."""

    name: str
    targets: tuple[str, ...]
    block: tuple[int, int | None]

    def matches(self, prefix: str) -> bool:
        for target in self.targets:
            if target == "Linear" or (target.startswith("re:") and re.fullmatch(target[3:], prefix)):
                return True
        return False


def _group(name: str, group: dict[str, Any]) -> SchemeGroup:
    w = group.get("weights") or {}
    a = group.get("input_activations") or {}
    where = f"quantization_config.config_groups.{name}"
    if w.get("num_bits") != 8 or w.get("type") != "float":
        raise ValueError(f"{where}.weights: armillary's compressed-tensors serves 8-bit float weights, not "
                         f"{w.get('num_bits')}-bit {w.get('type')}")
    if a and (a.get("num_bits") != 8 or a.get("type") != "float" or not a.get("dynamic")):
        raise ValueError(f"{where}.input_activations: only dynamic 8-bit float activations are supported "
                         f"(static input_scale schemes are not), got {a}")
    strategy = w.get("strategy")
    if strategy == "channel":
        block: tuple[int, int | None] = (1, None)
    elif strategy == "block":
        bs = w.get("block_structure")
        if not bs or len(bs) != 2:
            raise ValueError(f"{where}.weights.block_structure must be [rows, cols], not {bs!r}")
        block = (int(bs[0]), int(bs[1]))
    else:
        raise ValueError(f"{where}.weights.strategy {strategy!r}: channel or block are supported (per-tensor "
                         "scales of stacked layers are not)")
    targets = tuple(group.get("targets") or ("Linear",))
    return SchemeGroup(name, targets, block)


class CompressedTensorsConfig(QuantConfig):
    """The FP8 schemes of compressed-tensors; a layer takes the first group that targets it."""

    name = "compressed-tensors"

    def __init__(self, groups: tuple[SchemeGroup, ...], ignore: tuple[str, ...] = ()) -> None:
        super().__init__(ignore)
        self.groups = groups

    @classmethod
    def from_config(cls, quantization_config: dict[str, Any]) -> CompressedTensorsConfig:
        q = quantization_config
        fmt = q.get("format", "float-quantized")
        if fmt not in ("float-quantized", "naive-quantized"):
            raise ValueError(f"quantization_config.format {fmt!r}: armillary's compressed-tensors serves "
                             "float-quantized (FP8) checkpoints")
        groups = tuple(_group(name, g) for name, g in (q.get("config_groups") or {}).items())
        if not groups:
            raise ValueError("quantization_config.config_groups is empty")
        return cls(groups, tuple(q.get("ignore") or ()))

    def is_skipped(self, prefix: str) -> bool:
        return skipped(self.ignore, prefix)

    def _group_of(self, prefix: str) -> SchemeGroup | None:
        if self.is_skipped(prefix):
            return None
        return next((g for g in self.groups if g.matches(prefix)), None)

    def linear_method(self, layer: nn.Module, prefix: str) -> QuantMethod:
        group = self._group_of(prefix)
        return UnquantizedLinearMethod() if group is None else Fp8LinearMethod(group.block, "weight_scale")

    def moe_method(self, layer: nn.Module, prefix: str) -> FusedMoEMethod:
        group = self._group_of(prefix)
        return UnquantizedFusedMoEMethod() if group is None else Fp8MoEMethod(group.block, "weight_scale")
