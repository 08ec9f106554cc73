"""Token embedding and LM head: the vocabulary's two ends, split by vocabulary rows over tensor parallelism.

``VocabEmbedding.weight`` and ``LMHead.weight`` are [vocab_size, hidden_size] in the params dtype at tensor-parallel
size 1, loaded whole (``weight_loader``: no shard) from ``embed_tokens.weight`` / ``lm_head.weight``. Over N ranks
each keeps rows ``[r·P, (r+1)·P)``, P = ceil(vocab / N) (rows past the vocabulary zero): the embedding looks up the
ids it holds, zeroes the others and sums over the ranks; the head's logits are gathered from every rank and cut to
the vocabulary. A tied head shares the embedding's tensor (and its split) and is not a parameter of its own.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from armillary.errors import WeightLoadError
from armillary.layers.collectives import all_gather, all_reduce
from armillary.layers.loading import Index, copy_checked
from armillary.parallel import get_parallel


class _VocabRows(nn.Module):
    """The vocabulary matrix this rank holds: ``weight`` [rows, dim], global rows ``start`` .. ``start + rows``."""

    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__()
        par = get_parallel()
        self.vocab_size, self.tp_size = vocab_size, par.tp_size
        self.rows = -(-vocab_size // par.tp_size)
        self.start = par.tp_rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, dim), requires_grad=False)
        self.weight.weight_loader = self._load

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> Index:
        if shard_id is not None:
            raise WeightLoadError(f"a vocabulary matrix takes no shard (got {shard_id!r})")
        if loaded.shape[0] != self.vocab_size:
            raise WeightLoadError(f"vocabulary matrix expects {self.vocab_size} rows, the checkpoint tensor has "
                                  f"{loaded.shape[0]}")
        mine = loaded[self.start: self.start + self.rows]
        with torch.no_grad():
            param.data[mine.shape[0]:].zero_()  # padding rows past the vocabulary
        copy_checked(param, (slice(0, mine.shape[0]),), mine, "vocabulary matrix")
        return ()

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """This rank's logits columns [N, rows] -> every rank's, cut to the vocabulary [N, V] (a tied head's too)."""
        if self.tp_size == 1:
            return logits
        return all_gather(logits, self.tp_size)[:, : self.vocab_size]


class VocabEmbedding(_VocabRows):
    """``forward(ids [T]) -> [T, hidden]`` (``F.embedding``; over ranks, each adds the rows it holds)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        held = (local >= 0) & (local < self.rows)  # [T]
        out = F.embedding(local.clamp(0, self.rows - 1), self.weight) * held.unsqueeze(-1).to(self.weight.dtype)
        return all_reduce(out, self.tp_size)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}" + (f", rows {self.start}+{self.rows}"
                                                                  if self.tp_size > 1 else "")


class LMHead(_VocabRows):
    """``compute_logits(hidden [N, H]) -> float32 logits [N, V]``; ``tie_to(embedding)`` shares its weight."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        super().__init__(vocab_size, hidden_size)
        self.hidden_size = hidden_size

    def tie_to(self, embedding: VocabEmbedding) -> None:
        self.weight = embedding.weight  # the same rows of the same split

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.gather_logits(F.linear(hidden, self.weight).float())  # [N, rows] per rank

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, {self.vocab_size}"
