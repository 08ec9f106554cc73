"""The MTP draft head (DeepSeek-style; checkpoint ``model.layers.{num_hidden_layers}.*``), run by ``draft_forward``.

``enorm`` normalises the embedding of the next token, ``hnorm`` the hidden state the main model
(or the previous draft pass) produced at this position; ``eh_proj`` [H, 2H] maps
``[enorm(embedding) ; hnorm(hidden)]`` to H; one MoE decoder layer with its own latent cache
follows, and ``shared_head.norm`` is the final norm. The checkpoint's ``embed_tokens`` and
``shared_head.head`` copies are not loaded: the head reuses the main model's embedding and LM head.
"""
from __future__ import annotations

import torch
from torch import nn

from armillary.forward_batch import ForwardBatch
from armillary.layers import ReplicatedLinear, RMSNorm, VocabEmbedding
from armillary_glm_flash.config import GlmFlashConfig
from armillary_glm_flash.decoder import DecoderLayer, Rotary


class SharedHead(nn.Module):
    def __init__(self, cfg: GlmFlashConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MultiTokenPredictor(DecoderLayer):
    """The decoder layer's ``self_attn`` / ``mlp`` / norms, plus ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head``."""

    def __init__(self, cfg: GlmFlashConfig, prefix: str = "mtp") -> None:
        super().__init__(cfg, is_moe=True, prefix=prefix)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = ReplicatedLinear(2 * cfg.hidden_size, cfg.hidden_size, prefix=f"{prefix}.eh_proj")
        self.shared_head = SharedHead(cfg)

    def draft(self, batch: ForwardBatch, hidden: torch.Tensor, embed: VocabEmbedding, rotary: Rotary) -> torch.Tensor:
        """input_ids [T] (the token after each position), hidden [T, H] -> final-normed draft hidden [T, H]."""
        x = self.eh_proj(torch.cat((self.enorm(embed(batch.input_ids)), self.hnorm(hidden)), dim=-1))
        cos, sin = rotary(batch.positions)
        h, residual = super().forward(x, None, batch, batch.caches[0], cos, sin)
        return self.shared_head.norm.add(h, residual)[0]
