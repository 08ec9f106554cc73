"""``NemotronHForCausalLM``: the hybrid layer stack (Mamba-2 / attention / MoE / MLP blocks), the LM head, the cache layout and weight names.

Each block is ``h += mixer(RMSNorm(h))``; the residual add is fused into the next block's norm.
Checkpoint names: ``backbone.*`` (NVIDIA's, and what transformers 5 writes) or ``model.*`` both map
onto ``backbone.*``; ``lm_head.*`` stays (tied to the embedding only when the checkpoint has no
head and ``tie_word_embeddings`` is set); ``mtp.*`` tensors (Nemotron-3 Super's MTP head, not
served yet) are skipped with one log line.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from armillary.cache_spec import FullAttention, LayerCacheSpec, Recurrent
from armillary.errors import WeightLoadError
from armillary.forward_batch import ForwardBatch, KVCache, LayerCache, RecurrentState
from armillary.hf_config import HFConfig
from armillary.layers import CheckpointLoader, LMHead, RMSNorm, VocabEmbedding
from armillary.model_base import CausalLM
from armillary_nemotron.attention import NemotronHAttention
from armillary_nemotron.config import ATTENTION, MAMBA, MLP, MOE, NemotronHArgs
from armillary_nemotron.mamba_mixer import Mamba2Mixer
from armillary_nemotron.moe import NemotronHMoE, ReluSquaredMLP

logger = logging.getLogger(__name__)


def ssm_state_dtype(hf_config: HFConfig) -> torch.dtype:
    name = getattr(hf_config, "mamba_ssm_cache_dtype", None) or "float32"
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"config.json mamba_ssm_cache_dtype={name!r} is not a float dtype")
    return dtype


class NemotronHBlock(nn.Module):
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

    def __init__(self, hf_config: HFConfig) -> None:
        super().__init__()
        self.config = NemotronHArgs.parse(hf_config)
        cfg = self.config
        self.backbone = NemotronHBackbone(cfg)
        # transformers never ties nemotron_h's head (its _tied_weights_keys is empty) and saves lm_head.weight
        # even under tie_word_embeddings; the head is tied only when a checkpoint has none (load_weights)
        self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size)
        self.requires_grad_(False)

    @classmethod
    def cache_layout(cls, hf_config: HFConfig) -> list[LayerCacheSpec | None]:
        cfg = NemotronHArgs.parse(hf_config)
        mamba = Recurrent(shapes=((cfg.conv_dim, cfg.conv_kernel - 1), (cfg.mamba_heads, cfg.mamba_head_dim,
                                                                         cfg.state_size)),
                          dtypes=(None, ssm_state_dtype(hf_config)))
        attention = FullAttention(cfg.num_kv_heads, cfg.head_dim)
        return [mamba if k == MAMBA else attention if k == ATTENTION else None for k in cfg.kinds]

    @classmethod
    def max_model_len(cls, hf_config: HFConfig) -> int:
        return NemotronHArgs.parse(hf_config).max_position_embeddings

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.backbone(batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loader = CheckpointLoader(self)
        unknown: list[str] = []
        skipped_mtp, has_head = 0, False
        with torch.no_grad():
            for ckpt_name, tensor in weights:
                name = "backbone." + ckpt_name[len("model."):] if ckpt_name.startswith("model.") else ckpt_name
                if name.startswith("mtp."):
                    skipped_mtp += 1
                    continue
                has_head = has_head or name == "lm_head.weight"
                if loader.load(name, tensor, source=ckpt_name) is None:
                    unknown.append(ckpt_name)
        if skipped_mtp:
            logger.info("skipped %d mtp.* tensors (MTP is not served for nemotron_h yet)", skipped_mtp)
        if unknown:
            shown = ", ".join(sorted(unknown)[:20])
            more = f" and {len(unknown) - 20} more" if len(unknown) > 20 else ""
            raise WeightLoadError(f"checkpoint tensors the model does not know: {shown}{more}")
        if not has_head and self.config.tie_word_embeddings:
            self.lm_head.tie_to(self.backbone.embeddings)
        return loader.loaded()
