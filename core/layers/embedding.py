"""Token embedding and LM head: the vocabulary's two ends, replicated on every rank for now.

``VocabEmbedding.weight`` and ``LMHead.weight`` are [vocab_size, hidden_size] in the params
dtype, loaded whole (``weight_loader``: no shard) from ``embed_tokens.weight`` / ``lm_head.weight``;
a tied head shares the embedding's tensor and is not a parameter of its own.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from armillary.errors import WeightLoadError
from armillary.layers.loading import Index, copy_checked


def _vocab_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> Index:
    if shard_id is not None:
        raise WeightLoadError(f"a vocabulary matrix takes no shard (got {shard_id!r})")
    return copy_checked(param, (), loaded, "vocabulary matrix")


def _vocab_parameter(num_embeddings: int, dim: int) -> nn.Parameter:
    param = nn.Parameter(torch.empty(num_embeddings, dim), requires_grad=False)
    param.weight_loader = _vocab_weight_loader
    return param


class VocabEmbedding(nn.Module):
    """``forward(ids [T]) -> [T, hidden]`` (``F.embedding``)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = _vocab_parameter(num_embeddings, embedding_dim)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class LMHead(nn.Module):
    """``compute_logits(hidden [N, H]) -> float32 logits [N, V]``; ``tie_to(embedding)`` shares its weight."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        super().__init__()
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.weight = _vocab_parameter(vocab_size, hidden_size)

    def tie_to(self, embedding: VocabEmbedding) -> None:
        self.weight = embedding.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight).float()

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, {self.vocab_size}"
