"""Quantization methods of the shared layers: the contract, the unquantized default and the build-time context."""
from __future__ import annotations

from armillary.layers.quantization.base import FusedMoEMethod, QuantConfig, QuantMethod, register_weight
from armillary.layers.quantization.context import (
    UNQUANTIZED,
    get_quant_config,
    quantization_config_of,
    resolve_quant_config,
    use_quant_config,
)
from armillary.layers.quantization.unquantized import (
    UnquantizedConfig,
    UnquantizedFusedMoEMethod,
    UnquantizedLinearMethod,
)

__all__ = [
    "FusedMoEMethod", "QuantConfig", "QuantMethod", "register_weight", "UNQUANTIZED", "get_quant_config",
    "quantization_config_of", "resolve_quant_config", "use_quant_config", "UnquantizedConfig",
    "UnquantizedFusedMoEMethod", "UnquantizedLinearMethod",
]
