"""``NemotronHForCausalLM``: the hybrid layer stack (Mamba-2 / attention / MoE / MLP blocks), the LM head, the cache layout and weight names.

Each block is ``h += mixer(RMSNorm(h))``; the residual add is fused into the next block's norm.
Checkpoint names: ``backbone.*`` (NVIDIA's, and what transformers 5 writes) or ``model.*`` both map
onto ``backbone.*``; ``lm_head.*`` stays (tied to the embedding only when the checkpoint has no
head and ``tie_word_embeddings`` is set); ``mtp.layers.{j}.*`` (Nemotron-3 Super's MTP head, ``mtp.py``)
load into ``mtp`` when the config declares it (``num_nextn_predict_layers``) and it can draft, and
are skipped with one log line saying why otherwise.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from armillary.cache_spec import FullAttention, LayerCacheSpec, Recurrent
from armillary.errors import WeightLoadError
from armillary.forward_batch import ForwardBatch
from armillary.hf_config import HFConfig
from armillary.layers import CheckpointLoader, LMHead, RMSNorm, VocabEmbedding
from armillary.model_base import CausalLM
from armillary.parallel import get_parallel
from armillary_nemotron.block import NemotronHBlock
from armillary_nemotron.config import ATTENTION, MAMBA, NemotronHArgs
from armillary_nemotron.mamba_shard import mamba_shard
from armillary_nemotron.mtp import NemotronHMTP, mtp_cache_layout, mtp_unsupported

logger = logging.getLogger(__name__)


def ssm_state_dtype(hf_config: HFConfig) -> torch.dtype:
    name = getattr(hf_config, "mamba_ssm_cache_dtype", None) or "float32"
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"config.json mamba_ssm_cache_dtype={name!r} is not a float dtype")
    return dtype


class NemotronHBackbone(nn.Module):
    def __init__(self, cfg: NemotronHArgs, prefix: str = "backbone") -> None:
        super().__init__()
        self.embeddings = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(NemotronHBlock(cfg, kind, f"{prefix}.layers.{i}") for i, kind in enumerate(cfg.kinds))
        self.norm_f = RMSNorm(cfg.hidden_size, cfg.eps)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        h = self.embeddings(batch.input_ids)  # [T, H]
        residual = None
        for layer, cache in zip(self.layers, batch.caches):
            h, residual = layer(h, residual, batch, cache)
        return self.norm_f.add(h, residual)[0]


class NemotronHForCausalLM(CausalLM):
    """Built as ``cls(hf_config)`` under the target device and dtype (see ``armillary.model_base``)."""

    # Mamba heads (their groups, conv channels, states), attention heads, MLP / expert widths or whole experts
    # and the vocabulary rows split; the router is replicated (mamba_shard.py, attention.py, moe.py)
    supports_tensor_parallel = True

    def __init__(self, hf_config: HFConfig) -> None:
        super().__init__()
        self.config = NemotronHArgs.parse(hf_config)
        cfg = self.config
        self.backbone = NemotronHBackbone(cfg)
        # transformers never ties nemotron_h's head (its _tied_weights_keys is empty) and saves lm_head.weight
        # even under tie_word_embeddings; the head is tied only when a checkpoint has none (load_weights)
        self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size)
        self.mtp = NemotronHMTP(cfg) if cfg.mtp_kinds and mtp_unsupported(cfg) is None else None
        self.requires_grad_(False)

    @classmethod
    def cache_layout(cls, hf_config: HFConfig) -> list[LayerCacheSpec | None]:
        cfg = NemotronHArgs.parse(hf_config)
        shard = mamba_shard(cfg)  # this rank's heads and groups (inside use_parallel)
        mamba = Recurrent(shapes=((shard.conv_dim, cfg.conv_kernel - 1), (shard.heads, cfg.mamba_head_dim,
                                                                           cfg.state_size)),
                          dtypes=(None, ssm_state_dtype(hf_config)))
        attention = FullAttention(get_parallel().kv_heads(cfg.num_kv_heads), cfg.head_dim)
        return [mamba if k == MAMBA else attention if k == ATTENTION else None for k in cfg.kinds]

    @classmethod
    def draft_cache_layout(cls, hf_config: HFConfig) -> list[LayerCacheSpec | None]:
        cfg = NemotronHArgs.parse(hf_config)
        if not cfg.mtp_kinds:
            return []
        reason = mtp_unsupported(cfg)
        if reason is not None:
            raise NotImplementedError(f"nemotron_h MTP speculation: {reason}")
        return mtp_cache_layout(cfg)

    @classmethod
    def max_model_len(cls, hf_config: HFConfig) -> int:
        return NemotronHArgs.parse(hf_config).max_position_embeddings

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.backbone(batch)

    def draft_forward(self, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        """One MTP pass (see ``CausalLM.draft_forward``); ``batch.caches`` are the MTP sublayers' caches."""
        if self.mtp is None:
            raise NotImplementedError("this checkpoint's config declares no MTP layers (num_nextn_predict_layers)"
                                      if not self.config.mtp_kinds else mtp_unsupported(self.config))
        return self.mtp(batch, hidden, self.backbone.embeddings)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loader = CheckpointLoader(self)
        unknown: list[str] = []
        skipped_mtp, has_head = 0, False
        with torch.no_grad():
            for ckpt_name, tensor in weights:
                name = "backbone." + ckpt_name[len("model."):] if ckpt_name.startswith("model.") else ckpt_name
                if name.startswith("mtp.") and self.mtp is None:
                    skipped_mtp += 1
                    continue
                has_head = has_head or name == "lm_head.weight"
                if loader.load(name, tensor, source=ckpt_name) is None:
                    unknown.append(ckpt_name)
        if skipped_mtp:
            why = mtp_unsupported(self.config) or "the config declares no MTP layers (num_nextn_predict_layers)"
            logger.info("skipped %d mtp.* tensors: %s", skipped_mtp, why)
        if unknown:
            shown = ", ".join(sorted(unknown)[:20])
            more = f" and {len(unknown) - 20} more" if len(unknown) > 20 else ""
            raise WeightLoadError(f"checkpoint tensors the model does not know: {shown}{more}")
        if not has_head and self.config.tie_word_embeddings:
            self.lm_head.tie_to(self.backbone.embeddings)
        return loader.loaded()
