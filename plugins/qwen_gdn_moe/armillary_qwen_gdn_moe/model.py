"""The causal LM shared by Qwen3-Next and Qwen3.5 / 3.6: layer stack, LM head, optional MTP head.

Subclasses only say how to read their config (``parse``).
"""
from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterable

import torch

from armillary.cache_spec import FullAttention, LayerCacheSpec, Recurrent
from armillary.forward_batch import ForwardBatch
from armillary.hf_config import HFConfig
from armillary.layers import LMHead
from armillary.model_base import CausalLM
from armillary.parallel import get_parallel
from armillary_qwen_gdn_moe.config import LINEAR_ATTENTION, QwenHybridConfig
from armillary_qwen_gdn_moe.decoder import HybridModel
from armillary_qwen_gdn_moe.gated_deltanet import local_heads
from armillary_qwen_gdn_moe.mtp import MultiTokenPredictor
from armillary_qwen_gdn_moe.weights import load_qwen_weights


class QwenHybridForCausalLM(CausalLM):
    """Built as ``cls(hf_config)`` under ``torch.device(device)``, the model's default dtype, and the
    build contexts ``use_parallel`` / ``use_quant_config`` that the shared layers read."""

    snapshots_inside_chunks = True  # GatedDeltaNet saves prefix-cache checkpoints part-way through a chunk
    supports_tensor_parallel = True  # GDN and attention heads, expert widths split; embedding, router replicated

    @classmethod
    @abstractmethod
    def parse(cls, hf_config: HFConfig) -> QwenHybridConfig:
        """Read this architecture's config.json into the shared config."""

    def __init__(self, hf_config: HFConfig) -> None:
        super().__init__()
        self.config = self.parse(hf_config)
        cfg = self.config
        self.model = HybridModel(cfg)
        self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)
        self.mtp = MultiTokenPredictor(cfg) if cfg.mtp_num_layers > 0 else None
        self.requires_grad_(False)

    @classmethod
    def cache_layout(cls, hf_config: HFConfig) -> list[LayerCacheSpec | None]:
        cfg = cls.parse(hf_config)
        k_heads, v_heads = local_heads(cfg)  # this rank's share (inside use_parallel)
        conv_dim = 2 * k_heads * cfg.linear_key_head_dim + v_heads * cfg.linear_value_head_dim
        gdn_state = Recurrent(
            shapes=(
                (conv_dim, cfg.conv_kernel - 1),
                (v_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim),
            ),
            dtypes=(None, torch.float32),
        )
        attention = FullAttention(get_parallel().kv_heads(cfg.num_key_value_heads), cfg.head_dim)
        return [gdn_state if t == LINEAR_ATTENTION else attention for t in cfg.layer_types]

    @classmethod
    def draft_cache_layout(cls, hf_config: HFConfig) -> list[LayerCacheSpec | None]:
        cfg = cls.parse(hf_config)
        if cfg.mtp_num_layers == 0:
            return []
        if cfg.mtp_num_layers > 1:
            raise NotImplementedError(f"{cfg.mtp_num_layers} MTP layers: armillary drafts with one")
        return [FullAttention(cfg.num_key_value_heads, cfg.head_dim)]

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model(batch)

    def draft_forward(self, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        if self.mtp is None:
            raise NotImplementedError(f"{type(self).__name__}: this checkpoint has no MTP layers")
        return self.mtp(batch, hidden, self.model.embed_tokens, self.model.inv_freq)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_qwen_weights(self, weights, self.config.tie_word_embeddings)
