"""``quant_method: fp8`` (block-wise, as Qwen and DeepSeek publish) and online ``--quantization fp8``, with the skip-list matching both FP8 formats share.

Checkpoint: ``quantization_config = {quant_method: fp8, fmt: e4m3, activation_scheme: dynamic,
weight_block_size: [bn, bk], modules_to_not_convert: [...]}``; ``X.weight`` float8_e4m3fn and
``X.weight_scale_inv`` fp32 ``[ceil(out / bn), ceil(in / bk)]``. Online (``quantization_config``
absent, ``--quantization fp8`` / ``fp8_block``): bf16 weights quantized after loading, per output
row or in 128 x 128 blocks.
"""
from __future__ import annotations

import re
from typing import Any

from torch import nn

from armillary.layers.quantization.base import FusedMoEMethod, QuantConfig, QuantMethod
from armillary.layers.quantization.fp8_methods import Fp8LinearMethod, Fp8MoEMethod, OnlineFp8LinearMethod
from armillary.layers.quantization.unquantized import UnquantizedFusedMoEMethod, UnquantizedLinearMethod

# a stacked layer's checkpoint modules, per checkpoint layout: the layer is skipped when one layout's
# modules all are (vLLM's packed_modules_mapping); in_proj is Qwen GDN's [q | k | v | z | b | a]
PACKED_MODULES: dict[str, tuple[tuple[str, ...], ...]] = {
    "qkv_proj": (("q_proj", "k_proj", "v_proj"),),
    "gate_up_proj": (("gate_proj", "up_proj"),),
    "in_proj": (("in_proj_qkvz",), ("in_proj_qkv", "in_proj_z")),
}
ONLINE_METHODS = {"fp8": None, "fp8_block": (128, 128)}  # --quantization value -> weight block (None: per row)


def _plain(name: str) -> str:
    """A module path without a multimodal wrapper's ``language_model.`` component."""
    return name.replace("language_model.", "")


def _listed(ignore: tuple[str, ...], prefix: str) -> bool:
    """``prefix`` matches an entry: equal, inside it, ending with it, or ``re:<regex>`` in full."""
    plain = _plain(prefix)
    for entry in ignore:
        if entry.startswith("re:"):
            pattern = entry[3:]
            if any(re.fullmatch(pattern, p) for p in {prefix, plain, plain.replace("model.", "model.language_model.", 1)}):
                return True
            continue
        e = _plain(entry)
        if plain == e or plain.startswith(e + ".") or plain.endswith("." + e):
            return True
    return False


def skipped(ignore: tuple[str, ...], prefix: str) -> bool:
    """Whether the layer at ``prefix`` stays unquantized; a stacked layer whose checkpoint modules are
    listed only in part is a ``ValueError`` naming them (its rows cannot be half fp8)."""
    if not prefix:
        return False
    if _listed(ignore, prefix):
        return True
    parent, _, last = prefix.rpartition(".")
    layouts = PACKED_MODULES.get(last)
    if not layouts:
        return False
    some = []
    for modules in layouts:
        hits = [m for m in modules if _listed(ignore, f"{parent}.{m}")]
        if hits and len(hits) == len(modules):
            return True
        some += hits
    if some:
        raise ValueError(f"{prefix}: the quantization ignore list leaves only {some} of its stacked modules "
                         "unquantized; armillary needs all or none")
    return False


class Fp8Config(QuantConfig):
    """Block-wise FP8 weights with dynamic per-token-group activations."""

    name = "fp8"

    def __init__(self, block: tuple[int, int], ignore: tuple[str, ...] = ()) -> None:
        super().__init__(ignore)
        self.block = block

    @classmethod
    def from_config(cls, quantization_config: dict[str, Any]) -> QuantConfig:
        q = quantization_config
        ignore = tuple(q.get("modules_to_not_convert") or q.get("ignored_layers") or ())
        if q.get("online"):
            block = q.get("weight_block_size")
            return OnlineFp8Config(tuple(block) if block else None, ignore)
        if q.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"quantization_config.fmt {q.get('fmt')!r}: armillary's fp8 serves e4m3 only")
        if q.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError(f"quantization_config.activation_scheme {q.get('activation_scheme')!r}: armillary's "
                             "fp8 serves dynamic activation scales only")
        block = q.get("weight_block_size")
        if not block or len(block) != 2 or min(block) < 1:
            raise ValueError(f"quantization_config.weight_block_size {block!r}: armillary's fp8 serves block-wise "
                             "checkpoints ([128, 128]); per-tensor fp8 is not supported")
        return cls((int(block[0]), int(block[1])), ignore)

    def is_skipped(self, prefix: str) -> bool:
        return skipped(self.ignore, prefix)

    def linear_method(self, layer: nn.Module, prefix: str) -> QuantMethod:
        return UnquantizedLinearMethod() if self.is_skipped(prefix) else Fp8LinearMethod(self.block)

    def moe_method(self, layer: nn.Module, prefix: str) -> FusedMoEMethod:
        return UnquantizedFusedMoEMethod() if self.is_skipped(prefix) else Fp8MoEMethod(self.block)


class OnlineFp8Config(QuantConfig):
    """A bf16 / fp16 checkpoint quantized while loading: per output row (``block`` None) or block-wise."""

    name = "fp8"

    def __init__(self, block: tuple[int, int] | None = None, ignore: tuple[str, ...] = ()) -> None:
        super().__init__(ignore)
        self.block = block

    @classmethod
    def from_config(cls, quantization_config: dict[str, Any]) -> QuantConfig:
        return Fp8Config.from_config({**quantization_config, "online": True})

    def is_skipped(self, prefix: str) -> bool:
        return skipped(self.ignore, prefix)

    def linear_method(self, layer: nn.Module, prefix: str) -> QuantMethod:
        return UnquantizedLinearMethod() if self.is_skipped(prefix) else OnlineFp8LinearMethod(self.block)

    def moe_method(self, layer: nn.Module, prefix: str) -> FusedMoEMethod:
        if self.is_skipped(prefix):
            return UnquantizedFusedMoEMethod()
        return Fp8MoEMethod(self.block or (1, None), scale_name="weight_scale", online=True)


def online_quantization_config(method: str) -> dict[str, Any]:
    """The ``quantization_config`` that ``--quantization <method>`` stands for on an unquantized checkpoint."""
    if method not in ONLINE_METHODS:
        raise ValueError(f"--quantization {method!r}: choose one of {', '.join(ONLINE_METHODS)}")
    block = ONLINE_METHODS[method]
    return {"quant_method": "fp8", "online": True, "weight_block_size": list(block) if block else None,
            "modules_to_not_convert": ["lm_head"]}
