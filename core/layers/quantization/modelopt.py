"""``quant_method: modelopt`` as NVIDIA's TensorRT Model Optimizer exports it: ``NVFP4`` / ``W4A16_NVFP4``, per-tensor ``FP8``, and ``MIXED_PRECISION`` of both per module.

The config arrives either as ``config.json``'s ``quantization_config`` (``{quant_method: modelopt,
quant_algo, group_size, ignore | exclude_modules, quantized_layers}``) or as the older
``hf_quant_config.json`` (``{producer, quantization: {quant_algo, kv_cache_quant_algo, group_size,
exclude_modules, quantized_layers}}``, merged into the config by ``armillary.model_files``).
``exclude_modules`` entries are fnmatch wildcards over checkpoint module paths (``lm_head``,
``model.layers.*.mlp.gate``, ``*visual*``); ``quantized_layers`` (``MIXED_PRECISION``) maps each
checkpoint module to ``{quant_algo: FP8 | NVFP4 | W4A16_NVFP4}``, anything not listed stays in the
model dtype. Tensors: see ``nvfp4_methods`` (NVFP4) and ``Fp8PerTensorLinearMethod`` (FP8).
``online`` (``--quantization nvfp4`` on a bf16 checkpoint, ``ONLINE_NVFP4``): every linear and
expert weight but the excluded ones and those whose input is not whole groups of 16 is quantized
after loading as ModelOpt would have exported it.
"""
from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any

from torch import nn

from armillary.layers.quantization.base import FusedMoEMethod, QuantConfig, QuantMethod
from armillary.layers.quantization.fp8 import PACKED_MODULES, skipped
from armillary.layers.quantization.fp8_methods import Fp8PerTensorLinearMethod, Fp8PerTensorMoEMethod
from armillary.layers.quantization.nvfp4_methods import (
    MODELOPT,
    MODELOPT_W4A16,
    Nvfp4LinearMethod,
    Nvfp4MoEMethod,
    OnlineNvfp4LinearMethod,
    OnlineNvfp4MoEMethod,
)
from armillary.layers.quantization.unquantized import UnquantizedFusedMoEMethod, UnquantizedLinearMethod

ALGOS = ("NVFP4", "W4A16_NVFP4", "FP8")
GROUP_SIZE = 16
# what --quantization nvfp4 stands for on an unquantized checkpoint: routers and the head stay as stored
ONLINE_NVFP4 = {"quant_method": "modelopt", "quant_algo": "NVFP4", "online": True,
                "exclude_modules": ["lm_head", "*mlp.gate", "*shared_expert_gate"]}


def _variants(prefix: str) -> set[str]:
    """A layer path as the checkpoint may spell it: with or without a multimodal ``language_model.``."""
    plain = prefix.replace("language_model.", "")
    return {prefix, plain, plain.replace("model.", "model.language_model.", 1)}


def _excluded(patterns: tuple[str, ...], prefix: str) -> bool:
    """Whether a layer matches ``exclude_modules``: a plain entry as ``fp8.skipped`` matches it (equal,
    containing it, ending it), a wildcard by fnmatch; a stacked layer when all its checkpoint modules match."""
    wild = [p for p in patterns if any(c in p for c in "*?[")]
    plain = tuple(p for p in patterns if p not in wild)
    if plain and skipped(plain, prefix):
        return True

    def matched(path: str) -> bool:
        return any(fnmatchcase(v, w) for w in wild for v in _variants(path))

    if matched(prefix):
        return True
    parent, _, last = prefix.rpartition(".")
    return any(all(matched(f"{parent}.{m}") for m in modules) for modules in PACKED_MODULES.get(last, ()))


def _check_group(value: Any, where: str) -> None:
    if value is not None and int(value) != GROUP_SIZE:
        raise ValueError(f"{where}: NVFP4 group_size {value!r}; armillary serves groups of {GROUP_SIZE}")


class ModelOptConfig(QuantConfig):
    """One ``quant_algo`` for every quantized module, or ``MIXED_PRECISION`` (``layers``: module -> algo)."""

    name = "modelopt"

    def __init__(self, algo: str, exclude: tuple[str, ...] = (), layers: dict[str, str] | None = None,
                 kv_cache_algo: str | None = None, online: bool = False) -> None:
        super().__init__(exclude)
        self.algo, self.layers, self.kv_cache_algo, self.online = algo, dict(layers or {}), kv_cache_algo, online

    @classmethod
    def from_config(cls, quantization_config: dict[str, Any]) -> ModelOptConfig:
        q = quantization_config.get("quantization") or quantization_config  # hf_quant_config.json nests it
        where = "quantization_config" if q is quantization_config else "hf_quant_config.json quantization"
        algo = str(q.get("quant_algo") or "").upper()
        if not algo:
            raise ValueError(f"{where}.quant_algo is missing (modelopt checkpoints name NVFP4, FP8 or MIXED_PRECISION)")
        exclude = tuple(q.get("exclude_modules") or q.get("ignore") or ())
        if algo != "FP8":  # the NVFP4 groups (of MIXED_PRECISION's NVFP4 modules too)
            _check_group(q.get("group_size"), where)
        kv = q.get("kv_cache_quant_algo")
        if kv is None and isinstance(q.get("kv_cache_scheme"), dict):
            kv = "FP8"
        layers: dict[str, str] = {}
        if algo == "MIXED_PRECISION":
            listed = q.get("quantized_layers") or {}
            if not listed:
                raise ValueError(f"{where}.quantized_layers: MIXED_PRECISION needs the per-module quant_algo map")
            for module, info in listed.items():
                sub = str((info or {}).get("quant_algo") or "").upper()
                if sub not in ALGOS:
                    raise ValueError(f"{where}.quantized_layers[{module!r}].quant_algo {sub!r}: armillary's modelopt "
                                     f"serves {', '.join(ALGOS)}")
                if sub != "FP8":
                    _check_group(info.get("group_size"), f"{where}.quantized_layers[{module!r}]")
                layers[module] = sub
        elif algo not in ALGOS:
            raise ValueError(f"{where}.quant_algo {algo!r}: armillary's modelopt serves {', '.join(ALGOS)} and "
                             "MIXED_PRECISION")
        if q.get("online") and algo != "NVFP4":
            raise ValueError(f"{where}: online modelopt quantization is NVFP4 only, not {algo}")
        return cls(algo, exclude, layers, str(kv).upper() if kv else None, bool(q.get("online")))

    def is_skipped(self, prefix: str) -> bool:
        return bool(prefix) and _excluded(self.ignore, prefix)

    def algo_of(self, prefix: str) -> str | None:
        """The quant_algo of the layer at ``prefix`` (None: unquantized). A stacked layer takes its
        checkpoint modules' common algo (``PACKED_MODULES``); an MoE layer its experts'."""
        if self.is_skipped(prefix):
            return None
        if self.algo != "MIXED_PRECISION":
            return self.algo
        if not prefix:
            raise ValueError("a MIXED_PRECISION modelopt checkpoint picks each module's format by name; this layer "
                             "was built without a prefix")
        found = self._listed(prefix)
        if found is not None:
            return found
        parent, _, last = prefix.rpartition(".")
        for modules in PACKED_MODULES.get(last, ()):
            algos = {self._listed(f"{parent}.{m}") for m in modules}
            if algos == {None}:
                continue
            if len(algos) > 1:
                raise ValueError(f"{prefix}: its checkpoint modules {list(modules)} mix quant_algo "
                                 f"{sorted(map(str, algos))}; armillary needs one format per stacked layer")
            return algos.pop()
        algos = {a for module, a in self.layers.items() if any(module.startswith(p + ".") for p in _variants(prefix))}
        if len(algos) > 1:  # MoE experts: every expert projection in one format
            raise ValueError(f"{prefix}: its expert modules mix quant_algo {sorted(algos)}; armillary needs one "
                             "format per MoE layer")
        return algos.pop() if algos else None

    def _listed(self, module: str) -> str | None:
        return next((self.layers[p] for p in _variants(module) if p in self.layers), None)

    def linear_method(self, layer: nn.Module, prefix: str) -> QuantMethod:
        algo = self.algo_of(prefix)
        if self.online:  # layers whose input is not whole groups of 16 stay as loaded
            fits = algo is not None and layer.input_size_per_partition % GROUP_SIZE == 0
            return OnlineNvfp4LinearMethod() if fits else UnquantizedLinearMethod()
        if algo == "FP8":
            return Fp8PerTensorLinearMethod()
        if algo in ("NVFP4", "W4A16_NVFP4"):
            return Nvfp4LinearMethod(MODELOPT if algo == "NVFP4" else MODELOPT_W4A16)
        return UnquantizedLinearMethod()

    def moe_method(self, layer: nn.Module, prefix: str) -> FusedMoEMethod:
        algo = self.algo_of(prefix)
        if self.online:
            fits = algo is not None and layer.hidden_size % GROUP_SIZE == 0 and \
                layer.intermediate_size_per_partition % GROUP_SIZE == 0
            return OnlineNvfp4MoEMethod() if fits else UnquantizedFusedMoEMethod()
        if algo == "FP8":
            return Fp8PerTensorMoEMethod()
        if algo in ("NVFP4", "W4A16_NVFP4"):
            return Nvfp4MoEMethod(MODELOPT if algo == "NVFP4" else MODELOPT_W4A16)
        return UnquantizedFusedMoEMethod()
