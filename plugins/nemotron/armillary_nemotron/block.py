"""One Nemotron-H block, ``h += mixer(RMSNorm(h))`` with a Mamba-2, attention, relu² MoE or relu² MLP mixer (main stack and MTP head)."""
from __future__ import annotations

import torch
from torch import nn

from armillary.forward_batch import ForwardBatch, KVCache, LayerCache, RecurrentState
from armillary.layers import RMSNorm
from armillary_nemotron.attention import NemotronHAttention
from armillary_nemotron.config import ATTENTION, MAMBA, MOE, NemotronHArgs
from armillary_nemotron.mamba_mixer import Mamba2Mixer
from armillary_nemotron.moe import NemotronHMoE, ReluSquaredMLP


class NemotronHBlock(nn.Module):
    """``norm`` and ``mixer``, as the checkpoint names them; the residual add is fused into the next block's norm."""

    def __init__(self, cfg: NemotronHArgs, kind: str, prefix: str) -> None:
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(cfg.hidden_size, cfg.eps)
        if kind == MAMBA:
            self.mixer: nn.Module = Mamba2Mixer(cfg, prefix=f"{prefix}.mixer")
        elif kind == ATTENTION:
            self.mixer = NemotronHAttention(cfg, prefix=f"{prefix}.mixer")
        elif kind == MOE:
            self.mixer = NemotronHMoE(cfg, prefix=f"{prefix}.mixer")
        else:
            self.mixer = ReluSquaredMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_act, cfg.mlp_bias,
                                        prefix=f"{prefix}.mixer")

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch,
                cache: LayerCache | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(mixer output, residual stream), both [T, H]."""
        if residual is None:
            residual, x = h, self.norm(h)
        else:
            x, residual = self.norm.add(h, residual)
        if self.kind == MAMBA:
            if not isinstance(cache, RecurrentState):
                raise TypeError(f"a Mamba-2 layer needs a RecurrentState cache, got {type(cache).__name__}")
            return self.mixer(x, batch, cache), residual
        if self.kind == ATTENTION:
            if not isinstance(cache, KVCache):
                raise TypeError(f"an attention layer needs a KVCache, got {type(cache).__name__}")
            return self.mixer(x, batch, cache), residual
        return self.mixer(x), residual
