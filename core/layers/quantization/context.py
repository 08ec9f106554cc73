"""Which ``QuantConfig`` the model being built uses: a build-time context, and the checkpoint's choice of it.

A worker builds its model inside ``use_quant_config(resolve_quant_config(hf_config, registry))``
(as inside ``use_parallel``); each linear / MoE layer reads ``get_quant_config()`` once, in its
constructor. Outside any context the model is unquantized.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from armillary.errors import PluginError
from armillary.layers.quantization.base import QuantConfig
from armillary.layers.quantization.unquantized import UnquantizedConfig

UNQUANTIZED = UnquantizedConfig()
# --quantization values that name a checkpoint format (vLLM's spellings) -> its quant_method
CHECKPOINT_FORMATS = {"modelopt": "modelopt", "modelopt_fp4": "modelopt", "modelopt_mixed": "modelopt",
                      "compressed-tensors": "compressed-tensors"}
_current: QuantConfig = UNQUANTIZED


def get_quant_config() -> QuantConfig:
    """The config of the model being built (unquantized outside any ``use_quant_config``)."""
    return _current


@contextmanager
def use_quant_config(cfg: QuantConfig | None) -> Iterator[QuantConfig]:
    """Build a model for ``cfg`` (None: unquantized): layers constructed inside read it."""
    global _current
    old, _current = _current, cfg or UNQUANTIZED
    try:
        yield _current
    finally:
        _current = old


def quantization_config_of(hf_config: Any) -> dict[str, Any] | None:
    """``quantization_config`` of a config.json (top level, else the nested ``text_config``), as a dict."""
    for holder in (hf_config, _get(hf_config, "text_config")):
        found = _get(holder, "quantization_config") if holder is not None else None
        if found is not None:
            return found.to_dict() if hasattr(found, "to_dict") else dict(found)
    return None


def resolve_quant_config(hf_config: Any, registry: Any, online: str | None = None) -> QuantConfig:
    """The ``QuantConfig`` that ``quantization_config.quant_method`` names (absent: unquantized).

    ``registry``: a ``QuantizationRegistry`` or a ``PluginRegistry`` (its ``quantizations``).
    An unregistered method is a ``PluginError`` naming the registered ones. ``online``
    (``--quantization fp8`` / ``fp8_block``): an unquantized checkpoint is quantized while loading;
    an FP8 checkpoint keeps its own format; ``nvfp4``: bf16 weights quantized to NVFP4 while loading
    (``modelopt.ONLINE_NVFP4``). ``online`` naming a checkpoint format (``modelopt``,
    ``modelopt_fp4``, ``modelopt_mixed``, ``compressed-tensors``) only checks the checkpoint is one.
    """
    quant = quantization_config_of(hf_config)
    if online in CHECKPOINT_FORMATS:  # vLLM's names for a checkpoint's own format: it must be that one
        have = (quant or {}).get("quant_method")
        if have != CHECKPOINT_FORMATS[online]:
            raise PluginError(f"--quantization {online}: the checkpoint's quantization_config.quant_method is "
                              f"{have!r}, not {CHECKPOINT_FORMATS[online]!r}; drop the flag to use its own format")
        online = None
    if online is not None:
        from armillary.layers.quantization.fp8 import online_quantization_config
        from armillary.layers.quantization.modelopt import ONLINE_NVFP4

        wanted = dict(ONLINE_NVFP4) if online == "nvfp4" else online_quantization_config(online)
        if quant is None:
            quant = wanted
        elif online == "nvfp4" or quant.get("quant_method") not in ("fp8", "compressed-tensors"):
            raise PluginError(f"--quantization {online}: the checkpoint is already quantized as "
                              f"{quant.get('quant_method')!r}; drop the flag")
    if quant is None:
        return UNQUANTIZED
    method = quant.get("quant_method")
    if not method:
        raise PluginError(f"config.json's quantization_config has no quant_method: {sorted(quant)}")
    records = getattr(registry, "quantizations", registry)
    if method not in records:
        known = ", ".join(sorted(r.name for r in records)) or "none"
        raise PluginError(f"checkpoint quantization {method!r} (quantization_config.quant_method) is not served by "
                          f"any installed plugin; registered quantizations: {known}")
    cls = records.get(method).load()
    if not (isinstance(cls, type) and issubclass(cls, QuantConfig)):
        raise PluginError(f"quantization {method!r}: {records.get(method).config_cls} is not a QuantConfig subclass")
    return cls.from_config(quant)


def _get(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)
