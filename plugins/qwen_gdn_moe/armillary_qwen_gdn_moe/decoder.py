"""Decoder layer (token mixer + feed-forward, pre-norm residuals) and the layer stack."""
from __future__ import annotations

import torch
from torch import nn

from armillary.forward_batch import ForwardBatch, KVCache, LayerCache, RecurrentState
from armillary.kernels.rotary import rotary_cos_sin, rotary_inv_freq
from armillary.layers import GatedMLP, RMSNorm, VocabEmbedding
from armillary_qwen_gdn_moe.attention import GatedAttention
from armillary_qwen_gdn_moe.config import LINEAR_ATTENTION, QwenHybridConfig
from armillary_qwen_gdn_moe.gated_deltanet import GatedDeltaNet
from armillary_qwen_gdn_moe.moe import SparseMoeBlock


class DecoderLayer(nn.Module):
    """h += mixer(norm(h)); h += mlp(norm(h)). The mixer is ``linear_attn`` (GDN) or ``self_attn``."""

    def __init__(self, cfg: QwenHybridConfig, layer_type: str, is_moe: bool, prefix: str = "") -> None:
        super().__init__()
        self.is_linear = layer_type == LINEAR_ATTENTION
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg, prefix=f"{prefix}.linear_attn")
        else:
            self.self_attn = GatedAttention(cfg, prefix=f"{prefix}.self_attn")
        if is_moe:
            self.mlp: nn.Module = SparseMoeBlock(cfg, prefix=f"{prefix}.mlp")
        else:
            # gate and up kept apart: the tuned decode GEMMs are keyed on these shapes
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, merged=False,
                                prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centered=True)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centered=True)

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch, cache: LayerCache | None,
        cos: torch.Tensor, sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, residual): [T, H] each; the residual stream is added into the next norm (fused on the GPU).

        ``cache`` is this layer's ``RecurrentState`` or ``KVCache``.
        """
        if residual is None:
            residual, x = h, self.input_layernorm(h)
        else:
            x, residual = self.input_layernorm.add(h, residual)
        if self.is_linear:
            if not isinstance(cache, RecurrentState):
                raise TypeError(f"a GDN layer needs a RecurrentState cache, got {type(cache).__name__}")
            h = self.linear_attn(x, batch, cache)
        else:
            if not isinstance(cache, KVCache):
                raise TypeError(f"an attention layer needs a KVCache, got {type(cache).__name__}")
            h = self.self_attn(x, batch, cache, cos, sin)
        x, residual = self.post_attention_layernorm.add(h, residual)
        return self.mlp(x), residual


class HybridModel(nn.Module):
    """``embed_tokens``, ``layers``, final ``norm`` (checkpoint prefix ``model.``)."""

    def __init__(self, cfg: QwenHybridConfig, prefix: str = "model") -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, layer_type, cfg.is_moe(i), prefix=f"{prefix}.layers.{i}")
            for i, layer_type in enumerate(cfg.layer_types)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centered=True)
        self.register_buffer("inv_freq", rotary_inv_freq(cfg.rotary_dim, cfg.rope_theta), persistent=False)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """All new tokens of the step -> final-normed hidden states [T, H]."""
        h = self.embed_tokens(batch.input_ids)
        cos, sin = rotary_cos_sin(batch.positions, self.inv_freq)
        residual = None
        for i, layer in enumerate(self.layers):
            h, residual = layer(h, residual, batch, batch.caches[i], cos, sin)
        return self.norm.add(h, residual)[0]
