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

    ``snapshots_inside_chunks``: True when every recurrent layer honours ``ForwardBatch.state_snapshots``
    (saves a sequence's state part-way through its chunk to a snapshot row). Prefix caching then
    checkpoints inside a prefill chunk; otherwise the scheduler ends the chunk at the checkpoint,
    which costs an extra step per prompt.

    ``supports_tensor_parallel``: True when the model builds its shard inside ``use_parallel`` (its layers
    split by ``get_parallel()``) and ``cache_layout``, called inside it too, gives this rank's cache shapes;
    the engine refuses ``tensor_parallel_size`` > 1 for other models.
    """

    snapshots_inside_chunks: bool = False
    supports_tensor_parallel: bool = False

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

    # ---- optional draft head (MTP) for speculative decoding

    @classmethod
    def draft_cache_layout(cls, hf_config: HFConfig) -> list[LayerCacheSpec | None]:
        """What the draft head's layers keep between steps; ``[]`` when the checkpoint has none.

        Core appends these to ``cache_layout`` only when speculation is on; inside ``draft_forward``
        ``batch.caches[i]`` is the draft head's layer ``i`` (the main layers' caches are not there).
        """
        return []

    def draft_forward(self, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        """One pass of the draft head (MTP): ``batch.input_ids[t]`` is the token *after* position
        ``batch.positions[t]`` and ``hidden[t]`` ([T, H]) the final-normed hidden state the main
        model (or the previous draft pass) produced at that position. Returns the head's
        final-normed hidden ``[T, H]``: ``compute_logits`` of it drafts the token after that one,
        and it is the ``hidden`` of the next draft pass. Only called when
        ``draft_cache_layout`` is not empty."""
        raise NotImplementedError(f"{type(self).__name__} has no draft head")

    @classmethod
    def max_model_len(cls, hf_config: HFConfig) -> int | None:
        """Longest context the checkpoint supports, if the config says."""
        return getattr(cls.text_config(hf_config), "max_position_embeddings", None)

    @classmethod
    def text_config(cls, hf_config: HFConfig) -> HFConfig:
        """The language-model sub-config (multimodal checkpoints nest it under ``text_config``)."""
        return getattr(hf_config, "text_config", None) or hf_config
