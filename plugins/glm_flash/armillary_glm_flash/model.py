"""``Glm4MoeLiteForCausalLM`` (GLM-4.7-Flash): MLA layers over one latent cache group, LM head, MTP draft head."""
from __future__ import annotations

from collections.abc import Iterable

import torch

from armillary.cache_spec import LatentAttention, LayerCacheSpec
from armillary.forward_batch import ForwardBatch
from armillary.hf_config import HFConfig
from armillary.layers import LMHead
from armillary.model_base import CausalLM
from armillary_glm_flash.config import GlmFlashConfig
from armillary_glm_flash.decoder import GlmFlashModel
from armillary_glm_flash.mtp import MultiTokenPredictor
from armillary_glm_flash.weights import load_glm_weights


class Glm4MoeLiteForCausalLM(CausalLM):
    """Built as ``cls(hf_config)`` under ``torch.device(device)``, the model's default dtype, and the
    build contexts ``use_parallel`` / ``use_quant_config`` that the shared layers read."""

    # MLA heads (q_b / kv_b column-, o_proj row-parallel), dense MLP widths, expert widths or whole experts and the
    # vocabulary rows split; the down-projections, the router and the latent cache (whole on every rank) replicated
    supports_tensor_parallel = True

    def __init__(self, hf_config: HFConfig) -> None:
        super().__init__()
        self.config = cfg = GlmFlashConfig.from_hf(self.text_config(hf_config))
        self.model = GlmFlashModel(cfg)
        self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)
        self.mtp = MultiTokenPredictor(cfg) if cfg.num_nextn_predict_layers > 0 else None
        self.requires_grad_(False)

    @classmethod
    def _latent(cls, hf_config: HFConfig) -> tuple[GlmFlashConfig, LatentAttention]:
        """The same on every rank: the latent and its rope key are shared by all heads, so tensor parallelism
        splits the heads that read it, never the cache itself."""
        cfg = GlmFlashConfig.from_hf(cls.text_config(hf_config))
        return cfg, LatentAttention(cfg.kv_lora_rank, cfg.qk_rope_head_dim)

    @classmethod
    def cache_layout(cls, hf_config: HFConfig) -> list[LayerCacheSpec | None]:
        cfg, latent = cls._latent(hf_config)
        return [latent] * cfg.num_hidden_layers

    @classmethod
    def draft_cache_layout(cls, hf_config: HFConfig) -> list[LayerCacheSpec | None]:
        cfg, latent = cls._latent(hf_config)
        return [latent] if cfg.num_nextn_predict_layers > 0 else []

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model(batch)

    def draft_forward(self, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        """One MTP pass (see ``CausalLM.draft_forward``); ``batch.caches[0]`` is the MTP layer's latent cache."""
        if self.mtp is None:
            raise NotImplementedError("this checkpoint's config declares no MTP layer (num_nextn_predict_layers)")
        return self.mtp.draft(batch, hidden, self.model.embed_tokens, self.model.rotary)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_glm_weights(self, weights, self.config.num_hidden_layers, self.config.tie_word_embeddings)
