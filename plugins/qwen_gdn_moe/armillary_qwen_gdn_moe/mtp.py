"""Multi-token prediction head (checkpoint prefix ``mtp.``), loaded with the model for speculative decoding.

Layout (Qwen3-Next / Qwen3.5): ``pre_fc_norm_embedding`` and ``pre_fc_norm_hidden`` normalise the
next token's embedding and the main model's hidden state, ``fc`` [H, 2H] maps their concatenation
[embedding ; hidden] back to H, then full-attention decoder ``layers`` and a final ``norm``; the
logits reuse the main ``lm_head``. The draft step that runs it belongs to the speculative runner.
"""
from __future__ import annotations

import torch
from torch import nn

from armillary.forward_batch import ForwardBatch
from armillary.kernels.rotary import rotary_cos_sin
from armillary.layers import ReplicatedLinear, RMSNorm, VocabEmbedding
from armillary_qwen_gdn_moe.config import FULL_ATTENTION, QwenHybridConfig
from armillary_qwen_gdn_moe.decoder import DecoderLayer


class MultiTokenPredictor(nn.Module):
    def __init__(self, cfg: QwenHybridConfig, prefix: str = "mtp") -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.pre_fc_norm_embedding = RMSNorm(hidden, cfg.rms_norm_eps, zero_centered=True)
        self.pre_fc_norm_hidden = RMSNorm(hidden, cfg.rms_norm_eps, zero_centered=True)
        self.fc = ReplicatedLinear(2 * hidden, hidden, prefix=f"{prefix}.fc")
        # MTP layers are MoE exactly when the main model has experts
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, FULL_ATTENTION, is_moe=cfg.num_experts > 0, prefix=f"{prefix}.layers.{i}")
            for i in range(cfg.mtp_num_layers)
        )
        self.norm = RMSNorm(hidden, cfg.rms_norm_eps, zero_centered=True)

    def forward(self, batch: ForwardBatch, hidden: torch.Tensor, embed_tokens: VocabEmbedding,
                inv_freq: torch.Tensor) -> torch.Tensor:
        """batch.input_ids: [T] the token after each position; hidden: [T, H] final-normed -> [T, H]
        final-normed. One pass uses layer 0 (Qwen's checkpoints have one MTP layer)."""
        e = self.pre_fc_norm_embedding(embed_tokens(batch.input_ids))
        x = self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden)], dim=-1))
        cos, sin = rotary_cos_sin(batch.positions, inv_freq)
        x, residual = self.layers[0](x, None, batch, batch.caches[0], cos, sin)
        return self.norm.add(x, residual)[0]
