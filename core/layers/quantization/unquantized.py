"""Weights as stored (bf16 / fp16 / fp32): the default methods, and what skipped layers of a quantized model use."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from armillary.kernels import ops
from armillary.layers.quantization.base import FusedMoEMethod, QuantConfig, QuantMethod, register_weight


class UnquantizedLinearMethod(QuantMethod):
    """``weight`` [N, K] in the params dtype (nn.Linear's layout); ``apply`` is ``ops.linear``
    (the Triton skinny GEMM for decode-sized batches on the GPU where it wins, cuBLAS otherwise)."""

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype) -> None:
        weight = torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype)
        register_weight(layer, "weight", weight, output_dim=0, input_dim=1)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return ops.linear(x, layer.weight, bias)


class UnquantizedFusedMoEMethod(FusedMoEMethod):
    """``gate_up_proj`` [E, 2I, H] (rows [gate | up]) and ``down_proj`` [E, H, I] in the params
    dtype; ``apply`` is ``ops.fused_moe``."""

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype) -> None:
        rows = (2 if layer.gated else 1) * intermediate_size_per_partition
        register_weight(layer, "gate_up_proj", torch.empty(num_experts, rows, hidden_size, dtype=params_dtype),
                        moe_dim=1)
        register_weight(layer, "down_proj",
                        torch.empty(num_experts, hidden_size, intermediate_size_per_partition, dtype=params_dtype),
                        moe_dim=2)

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        return ops.fused_moe(x, layer.gate_up_proj, layer.down_proj, topk_weights, topk_ids, layer.activation)


class UnquantizedConfig(QuantConfig):
    """No quantization: every layer gets the unquantized methods (the default build context)."""

    name = "unquantized"

    @classmethod
    def from_config(cls, quantization_config: dict[str, Any]) -> UnquantizedConfig:
        return cls()

    def linear_method(self, layer: nn.Module, prefix: str) -> QuantMethod:
        return UnquantizedLinearMethod()

    def moe_method(self, layer: nn.Module, prefix: str) -> FusedMoEMethod:
        return UnquantizedFusedMoEMethod()
