"""``quant_method: compressed-tensors`` as llm-compressor / RedHatAI publish: FP8 per-channel (FP8_DYNAMIC) or block weights with dynamic activations, and NVFP4 (``nvfp4-pack-quantized``).

``config_groups.<g> = {targets: ["Linear" | "re:<regex>"], weights: {num_bits: 8, type: float,
strategy: channel | block, block_structure: [bn, bk]}, input_activations: {num_bits: 8, type:
float, dynamic: true, strategy: token | group}}``; ``ignore`` lists modules left in bf16. Tensors:
``X.weight`` float8_e4m3fn, ``X.weight_scale`` fp32 ``[out, 1]`` (channel) or ``[ceil(out / bn),
ceil(in / bk)]`` (block). Activations are quantized per token and group of 128 at run time either
way (at least as fine as the checkpoint asks).

NVFP4 groups (``format: nvfp4-pack-quantized``, top level or per group; ``weights: {num_bits: 4,
type: float, strategy: tensor_group, group_size: 16}``, ``input_activations`` the same or null for
W4A16): ``X.weight_packed`` uint8 [out, in / 2] (low nibble first), ``X.weight_scale``
float8_e4m3fn [out, in / 16], ``X.weight_global_scale`` fp32 [1] and ``X.input_global_scale``.
Both global scales are stored as the *reciprocal* of the factor they stand for (llm-compressor's
``448 · 6 / amax``; vLLM dequantizes with ``1 / weight_global_scale``), so
w = e2m1 · weight_scale / weight_global_scale; see ``nvfp4_methods``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from torch import nn

from armillary.layers.quantization.base import FusedMoEMethod, QuantConfig, QuantMethod
from armillary.layers.quantization.fp8 import skipped
from armillary.layers.quantization.fp8_methods import Fp8LinearMethod, Fp8MoEMethod
from armillary.layers.quantization.nvfp4_methods import (
    COMPRESSED_TENSORS,
    COMPRESSED_TENSORS_W4A16,
    Nvfp4LinearMethod,
    Nvfp4MoEMethod,
    Nvfp4Names,
)
from armillary.layers.quantization.unquantized import UnquantizedFusedMoEMethod, UnquantizedLinearMethod


@dataclass(frozen=True, slots=True)
class SchemeGroup:
    """One config group: the modules it targets and its FP8 weight block ((1, None): per output channel),
    or ``nvfp4``: the NVFP4 tensor names it stores."""

    name: str
    targets: tuple[str, ...]
    block: tuple[int, int | None]
    nvfp4: Nvfp4Names | None = None

    def matches(self, prefix: str) -> bool:
        for target in self.targets:
            if target == "Linear" or (target.startswith("re:") and re.fullmatch(target[3:], prefix)):
                return True
        return False


NVFP4_FORMAT = "nvfp4-pack-quantized"
FP8_FORMATS = ("float-quantized", "naive-quantized")


def _nvfp4_group(name: str, group: dict[str, Any], where: str) -> SchemeGroup:
    w, a = group.get("weights") or {}, group.get("input_activations")
    if w.get("num_bits") != 4 or w.get("type") != "float" or w.get("strategy") != "tensor_group" \
            or int(w.get("group_size") or 0) != 16:
        raise ValueError(f"{where}.weights: nvfp4-pack-quantized takes 4-bit float tensor_group weights in groups of "
                         f"16, got {w}")
    if a and (a.get("num_bits") != 4 or a.get("type") != "float"):
        raise ValueError(f"{where}.input_activations: an NVFP4 group takes 4-bit float activations or none, got {a}")
    names = COMPRESSED_TENSORS if a else COMPRESSED_TENSORS_W4A16
    return SchemeGroup(name, tuple(group.get("targets") or ("Linear",)), (1, None), names)


def _group(name: str, group: dict[str, Any], fmt: str = "float-quantized") -> SchemeGroup:
    w = group.get("weights") or {}
    a = group.get("input_activations") or {}
    where = f"quantization_config.config_groups.{name}"
    fmt = group.get("format") or fmt
    if fmt == NVFP4_FORMAT:
        return _nvfp4_group(name, group, where)
    if fmt not in FP8_FORMATS:
        raise ValueError(f"{where}.format {fmt!r}: armillary's compressed-tensors serves float-quantized (FP8) and "
                         f"{NVFP4_FORMAT} groups")
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
    """The FP8 and NVFP4 schemes of compressed-tensors; a layer takes the first group that targets it."""

    name = "compressed-tensors"

    def __init__(self, groups: tuple[SchemeGroup, ...], ignore: tuple[str, ...] = ()) -> None:
        super().__init__(ignore)
        self.groups = groups

    @classmethod
    def from_config(cls, quantization_config: dict[str, Any]) -> CompressedTensorsConfig:
        q = quantization_config
        fmt = q.get("format", "float-quantized")
        if fmt not in (*FP8_FORMATS, NVFP4_FORMAT, "mixed-precision"):
            raise ValueError(f"quantization_config.format {fmt!r}: armillary's compressed-tensors serves "
                             f"float-quantized (FP8), {NVFP4_FORMAT} and mixed-precision of those")
        groups = tuple(_group(name, g, fmt) for name, g in (q.get("config_groups") or {}).items())
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
        if group is not None and group.nvfp4 is not None:
            return Nvfp4LinearMethod(group.nvfp4)
        return UnquantizedLinearMethod() if group is None else Fp8LinearMethod(group.block, "weight_scale")

    def moe_method(self, layer: nn.Module, prefix: str) -> FusedMoEMethod:
        group = self._group_of(prefix)
        if group is not None and group.nvfp4 is not None:
            return Nvfp4MoEMethod(group.nvfp4)
        return UnquantizedFusedMoEMethod() if group is None else Fp8MoEMethod(group.block, "weight_scale")
