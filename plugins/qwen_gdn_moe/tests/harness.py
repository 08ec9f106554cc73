"""A small stand-in for the engine runner: load a checkpoint directory into the armillary model,
allocate its caches, and run steps from hand-built ``ForwardBatch``es (paged KV, state slots)."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

import armillary_qwen_gdn_moe.hooks as qwen_hooks
from armillary.cache_spec import FullAttention, LayerCacheSpec, Recurrent
from armillary.forward_batch import ForwardBatch, KVCache, LayerCache, RecurrentState
from armillary.hf_config import HFConfig
from armillary.registry import PluginRegistry


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def build_model(model_dir: Path, dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, HFConfig]:
    """Resolve the class through the plugin's hooks, construct it, load and check every parameter."""
    config = HFConfig.from_file(Path(model_dir) / "config.json")
    registry = PluginRegistry()
    registry.register(qwen_hooks, "qwen_gdn_moe")
    cls = registry.resolve_architecture(config.architectures).load()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("cpu"):
            model = cls(config)
    finally:
        torch.set_default_dtype(previous)
    loaded = model.load_weights(iter_safetensors(model_dir))
    unfilled = {name for name, _ in model.named_parameters()} - loaded
    if unfilled:
        raise AssertionError(f"parameters left unfilled: {sorted(unfilled)}")
    return model.eval(), config


def allocate(spec: LayerCacheSpec | None, num_blocks: int, block_size: int, num_slots: int, dtype: torch.dtype) -> LayerCache | None:
    if isinstance(spec, FullAttention):
        k = torch.zeros(num_blocks, block_size, spec.kv_heads, spec.head_dim, dtype=dtype)
        v = torch.zeros(num_blocks, block_size, spec.kv_heads, spec.v_head_dim or spec.head_dim, dtype=dtype)
        return KVCache(k, v)
    if isinstance(spec, Recurrent):
        return RecurrentState(tuple(torch.zeros(num_slots, *s, dtype=d or dtype) for s, d in zip(spec.shapes, spec.dtypes)))
    assert spec is None, spec
    return None


@dataclass
class _Sequence:
    slot: int
    blocks: list[int] = field(default_factory=list)
    num_cached: int = 0


class Harness:
    """``step([(seq_id, new_tokens), ...])`` runs one batch and returns each sequence's last logits."""

    def __init__(self, model_dir: Path, num_blocks: int = 128, block_size: int = 8, num_slots: int = 8,
                 dtype: torch.dtype = torch.float32) -> None:
        self.model, self.config = build_model(model_dir, dtype)
        layout = type(self.model).cache_layout(self.config)
        self.caches = [allocate(s, num_blocks, block_size, num_slots, dtype) for s in layout]
        self.block_size = block_size
        self.free_blocks = list(range(num_blocks))
        self.free_slots = list(range(num_slots))
        self.seqs: dict[int, _Sequence] = {}

    def _sequence(self, seq_id: int) -> _Sequence:
        if seq_id not in self.seqs:
            slot = self.free_slots.pop()
            for cache in self.caches:
                if isinstance(cache, RecurrentState):
                    for t in cache.tensors:
                        t[slot] = 0  # the runner zeroes a slot when it hands it out
            self.seqs[seq_id] = _Sequence(slot)
        return self.seqs[seq_id]

    @torch.inference_mode()
    def step(self, work: list[tuple[int, list[int]]]) -> torch.Tensor:
        ids, positions, slot_mapping, qsl, ctx, lens = [], [], [], [0], [], []
        for seq_id, tokens in work:
            seq = self._sequence(seq_id)
            for pos in range(seq.num_cached, seq.num_cached + len(tokens)):
                if pos // self.block_size >= len(seq.blocks):
                    seq.blocks.append(self.free_blocks.pop(0))
                slot_mapping.append(seq.blocks[pos // self.block_size] * self.block_size + pos % self.block_size)
                positions.append(pos)
            ids += tokens
            qsl.append(qsl[-1] + len(tokens))
            ctx.append(seq.num_cached)
            lens.append(seq.num_cached + len(tokens))
        width = max(len(self.seqs[s].blocks) for s, _ in work)
        tables = [self.seqs[s].blocks + [0] * (width - len(self.seqs[s].blocks)) for s, _ in work]
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            context_lens=torch.tensor(ctx, dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            state_slots=torch.tensor([self.seqs[s].slot for s, _ in work], dtype=torch.int64),
            logits_indices=torch.tensor(qsl[1:], dtype=torch.int64) - 1,
            caches=self.caches,
            query_start_loc_cpu=qsl,
            context_lens_cpu=ctx,
            seq_lens_cpu=lens,
            is_decode_only=all(len(t) == 1 for _, t in work),
        )
        hidden = self.model(batch)
        for (seq_id, tokens), length in zip(work, lens):
            self.seqs[seq_id].num_cached = length
        return self.model.compute_logits(hidden[batch.logits_indices])
