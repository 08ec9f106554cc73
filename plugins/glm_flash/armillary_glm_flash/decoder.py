"""The glm4_moe_lite decoder layer (MLA + dense MLP or MoE, pre-norm residuals) and the layer stack."""
from __future__ import annotations

import torch
from torch import nn

from armillary.forward_batch import ForwardBatch, LatentCache, LayerCache
from armillary.kernels.rotary import rotary_cos_sin
from armillary.layers import GatedMLP, RMSNorm, VocabEmbedding
from armillary_glm_flash.attention import LatentAttention
from armillary_glm_flash.config import GlmFlashConfig
from armillary_glm_flash.moe import MoEBlock
from armillary_glm_flash.rope import rope_inv_freq


class DecoderLayer(nn.Module):
    """h += self_attn(norm(h)); h += mlp(norm(h)); the mlp is ``MoEBlock`` (sparse) or a gated MLP (dense)."""

    def __init__(self, cfg: GlmFlashConfig, is_moe: bool, prefix: str = "") -> None:
        super().__init__()
        self.self_attn = LatentAttention(cfg, prefix=f"{prefix}.self_attn")
        if is_moe:
            self.mlp: nn.Module = MoEBlock(cfg, prefix=f"{prefix}.mlp")
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch, cache: LayerCache | None,
                cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, residual): [T, H] each; the residual stream is added into the next norm (fused on the GPU)."""
        if not isinstance(cache, LatentCache):
            raise TypeError(f"an MLA layer needs a LatentCache, got {type(cache).__name__}")
        if residual is None:
            residual, x = h, self.input_layernorm(h)
        else:
            x, residual = self.input_layernorm.add(h, residual)
        h = self.self_attn(x, batch, cache, cos, sin)
        x, residual = self.post_attention_layernorm.add(h, residual)
        return self.mlp(x), residual


class Rotary(nn.Module):
    """cos / sin of the rope dims at the batch's positions, with yarn's attention factor folded in."""

    def __init__(self, cfg: GlmFlashConfig) -> None:
        super().__init__()
        inv_freq, self.attention_factor = rope_inv_freq(cfg.rope, cfg.qk_rope_head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rotary_cos_sin(positions, self.inv_freq)  # [T, rope // 2] float32 each
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos, sin


class GlmFlashModel(nn.Module):
    """``embed_tokens``, ``layers``, final ``norm`` (checkpoint prefix ``model.``)."""

    def __init__(self, cfg: GlmFlashConfig, prefix: str = "model") -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, cfg.is_moe(i), prefix=f"{prefix}.layers.{i}")
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """All new tokens of the step -> final-normed hidden states [T, H]."""
        h = self.embed_tokens(batch.input_ids)
        cos, sin = self.rotary(batch.positions)
        residual = None
        for i, layer in enumerate(self.layers):
            h, residual = layer(h, residual, batch, batch.caches[i], cos, sin)
        return self.norm.add(h, residual)[0]
