"""The gated MLP ``down(act(gate(x)) · up(x))`` of dense layers and shared experts, from the parallel linears."""
from __future__ import annotations

import torch
from torch import nn

from armillary.kernels.activation import act_and_mul, get_activation
from armillary.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from armillary.layers.quantization.base import QuantConfig


class GatedMLP(nn.Module):
    """SwiGLU-style MLP: ``hidden -> intermediate (gate, up) -> hidden``, tensor-parallel over the
    intermediate size.

    ``merged=True``: one ``gate_up_proj`` (``MergedColumnParallelLinear``, shards 0 = gate,
    1 = up; ``checkpoint_pieces`` maps the checkpoint's ``gate_proj`` / ``up_proj`` onto them) —
    one GEMM launch for both. ``merged=False``: separate ``gate_proj`` and ``up_proj``
    (``ColumnParallelLinear``), named as the checkpoint, for models whose tuned kernels are
    keyed on those shapes. Either way ``down_proj`` is a ``RowParallelLinear``; with
    ``reduce_results=False`` its partial sums are left to the caller.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu", bias: bool = False, *,
                 merged: bool = True, reduce_results: bool = True, quant_config: QuantConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__()
        self.merged, self.activation = merged, activation
        sub = f"{prefix}." if prefix else ""
        if merged:
            self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias,
                                                           quant_config=quant_config, prefix=f"{sub}gate_up_proj")
        else:
            self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias, quant_config=quant_config,
                                                  prefix=f"{sub}gate_proj")
            self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias, quant_config=quant_config,
                                                prefix=f"{sub}up_proj")
            self.act = get_activation(activation)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, reduce_results=reduce_results,
                                           quant_config=quant_config, prefix=f"{sub}down_proj")

    def checkpoint_pieces(self, local_name: str, tensor: torch.Tensor) -> list | None:
        """``gate_proj.<attr>`` / ``up_proj.<attr>`` -> shard 0 / 1 of ``gate_up_proj.<attr>`` (merged only)."""
        proj, _, attr = local_name.partition(".")
        if not self.merged or proj not in ("gate_proj", "up_proj") or not attr:
            return None
        return [(f"gate_up_proj.{attr}", tensor, {"shard_id": 0 if proj == "gate_proj" else 1})]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.merged:
            return self.down_proj(act_and_mul(self.gate_up_proj(x), self.activation))
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
