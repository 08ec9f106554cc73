"""The packed, variable-length input of one model step.

All new tokens of the step are flattened into ``[T]``; sequence ``b`` owns tokens
``query_start_loc[b]:query_start_loc[b+1]``. Prefill chunks and decodes mix freely in one batch
(a decode is a sequence with one new token). Models read their layer's cache through
``batch.caches[layer_idx]``; the runner fills every field, models never build one.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class KVCache:
    """Paged K/V of one attention layer: ``k: [num_blocks, block_size, Hkv, D]``, ``v`` likewise.

    Token ``t`` of a sequence lives in block ``block_tables[b, t // block_size]`` at offset
    ``t % block_size``; ``slot_mapping`` gives each new token's flat slot
    ``block * block_size + offset`` so writes need no table lookup.
    """

    k: torch.Tensor
    v: torch.Tensor
    group: int = 0  # the cache group whose block table and slot mapping address this layer
    k_scale: torch.Tensor | None = None  # per-layer dequantization scales of a quantized (FP8) cache
    v_scale: torch.Tensor | None = None

    @property
    def block_size(self) -> int:
        return self.k.shape[1]


@dataclass(slots=True)
class LatentCache:
    """Paged MLA latent of one layer: ``kv: [num_blocks, block_size, kv_lora_rank + rope_dim]``."""

    kv: torch.Tensor
    group: int = 0


@dataclass(slots=True)
class RecurrentState:
    """Per-sequence state of one recurrent layer: ``tensors[i]: [num_slots, *shapes[i]]``.

    A slot is zeroed by the runner when a sequence is given it, so a layer always continues from
    ``tensors[i][state_slots[b]]`` and writes its new state back there.
    """

    tensors: tuple[torch.Tensor, ...]


LayerCache = KVCache | LatentCache | RecurrentState


@dataclass(slots=True)
class ForwardBatch:
    """Inputs of one step. ``B`` sequences, ``T`` new tokens.

    input_ids:        [T] int64
    positions:        [T] int64, absolute position of each new token
    query_start_loc:  [B+1] int32, cu_seqlens of the new tokens
    context_lens:     [B] int32, tokens already cached before this step
    seq_lens:         [B] int32, context_lens + new tokens
    slot_mapping:     [T] int64, flat KV slot of each new token (cache group 0's)
    block_tables:     [B, max_blocks] int32, padded with 0 (cache group 0's)
    state_slots:      [B] int64, recurrent-state slot of each sequence
    logits_indices:   [N] int64, rows of the hidden output whose logits are sampled
    caches:           per layer of the model's cache_layout, or None
    group_block_tables, group_slot_mappings:
                      the same per paged cache group (index = ``KVCache.group``); a layer reads
                      its own through ``block_tables_of`` / ``slot_mapping_of``
    *_cpu:            host copies of the small per-sequence vectors, for reference paths;
                      None inside CUDA-graph decode steps, so a host-list kernel fails loudly there
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    query_start_loc: torch.Tensor
    context_lens: torch.Tensor
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    state_slots: torch.Tensor
    logits_indices: torch.Tensor
    caches: list[LayerCache | None]
    query_start_loc_cpu: list[int] | None = field(default_factory=list)
    context_lens_cpu: list[int] | None = field(default_factory=list)
    seq_lens_cpu: list[int] | None = field(default_factory=list)
    is_decode_only: bool = False
    max_seq_len: int = 0  # longest seq_len; a CUDA graph passes its bucket's limit (kernel grids use it)
    group_block_tables: list[torch.Tensor] = field(default_factory=list)
    group_slot_mappings: list[torch.Tensor] = field(default_factory=list)
    # a verify step (every sequence: K+1 tokens): [B, K] state rows to keep each sequence's recurrent
    # state after its positions 0..K-1 in; the state after the last goes to its slot as usual
    spec_state_rows: torch.Tensor | None = None
    # prefix caching, models with ``snapshots_inside_chunks``: (sequence b, n, row): each recurrent layer
    # saves sequence b's state after the first n tokens of its chunk (0 < n < its length) to snapshot row
    state_snapshots: list[tuple[int, int, int]] = field(default_factory=list)

    def block_tables_of(self, cache: KVCache | LatentCache) -> torch.Tensor:
        """[B, max_blocks] block table of ``cache``'s group."""
        return self.group_block_tables[cache.group] if self.group_block_tables else self.block_tables

    def slot_mapping_of(self, cache: KVCache | LatentCache) -> torch.Tensor:
        """[T] flat slot of each new token in ``cache``'s group."""
        return self.group_slot_mappings[cache.group] if self.group_slot_mappings else self.slot_mapping

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def max_query_len(self) -> int:
        q = self.query_start_loc_cpu
        return max((q[i + 1] - q[i] for i in range(len(q) - 1)), default=0)
