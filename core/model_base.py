"""The contract a model class (shipped by a plugin) fulfils."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

import torch
from torch import nn

from armillary.cache_spec import LayerCacheSpec
from armillary.forward_batch import ForwardBatch
from armillary.hf_config import HFConfig


class CausalLM(nn.Module, ABC):
    """A decoder that runs on packed ``ForwardBatch`` input.

    Constructed as ``cls(hf_config)`` under ``torch.device(device)`` with the model dtype as torch's
    default dtype; parameters may be left uninitialised since ``load_weights`` fills them all.
    """

    @classmethod
    @abstractmethod
    def cache_layout(cls, hf_config: HFConfig) -> list[LayerCacheSpec | None]:
        """Per layer, what it keeps between steps (index = ``ForwardBatch.caches`` index)."""

    @abstractmethod
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run all ``T`` new tokens, updating caches; returns hidden states ``[T, H]``."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden: [N, H]`` (already the final-normed output rows) -> float32 logits ``[N, V]``."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors into parameters; return the parameter names filled.

        Must raise ``WeightLoadError`` naming any checkpoint tensor it does not know. Tensors it
        deliberately skips (e.g. a vision tower of a text-only model) are skipped silently but
        logged once. The loader raises on parameters left unfilled.
        """

    @classmethod
    def max_model_len(cls, hf_config: HFConfig) -> int | None:
        """Longest context the checkpoint supports, if the config says."""
        return getattr(cls.text_config(hf_config), "max_position_embeddings", None)

    @classmethod
    def text_config(cls, hf_config: HFConfig) -> HFConfig:
        """The language-model sub-config (multimodal checkpoints nest it under ``text_config``)."""
        return getattr(hf_config, "text_config", None) or hf_config
