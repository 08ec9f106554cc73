"""Drive the real engine's model, pools and runner with hand-picked steps.

The engine loads the checkpoint (through the plugin registered by hand) and owns the caches;
``Harness.step`` chooses exactly which tokens of which sequences go into one forward, which
the scheduler would otherwise decide, and returns each sequence's last logits.
"""
from __future__ import annotations

from pathlib import Path

import torch

import armillary_qwen_gdn_moe.hooks as qwen_hooks
from armillary.config import EngineConfig
from armillary.engine import LLMEngine
from armillary.hf_config import HFConfig
from armillary.registry import PluginRegistry
from armillary.sampling_params import SamplingParams
from armillary.sequence import Sequence
from armillary.step_plan import ScheduledChunk, StepPlan


def qwen_registry() -> PluginRegistry:
    registry = PluginRegistry()
    registry.register(qwen_hooks, "qwen_gdn_moe")
    return registry


def build_engine(model_dir: Path, dtype: str = "float32", **kw) -> LLMEngine:
    config = EngineConfig(model=str(model_dir), dtype=dtype, device="cpu", max_model_len=512, **kw)
    return LLMEngine(config, registry=qwen_registry())


def build_model(model_dir: Path, dtype: str = "float32") -> tuple[torch.nn.Module, HFConfig]:
    """The loaded model (the engine's loader fails on unfilled or unknown tensors)."""
    engine = build_engine(model_dir, dtype, num_kv_blocks=4, max_num_seqs=1)
    return engine.model, engine.hf_config


class Harness:
    """``step([(seq_id, new_tokens), ...])`` runs one forward and returns each sequence's last logits."""

    def __init__(self, model_dir: Path, dtype: str = "float32") -> None:
        self.engine = build_engine(model_dir, dtype, block_size=8, num_kv_blocks=128, max_num_seqs=8)
        self.model = self.engine.model
        self.seqs: dict[int, Sequence] = {}

    def _sequence(self, seq_id: int) -> Sequence:
        if seq_id not in self.seqs:
            seq = Sequence(str(seq_id), 0, [], SamplingParams())
            self.seqs[seq_id] = seq
        return self.seqs[seq_id]

    @torch.inference_mode()
    def step(self, work: list[tuple[int, list[int]]]) -> torch.Tensor:
        chunks = []
        cache = self.engine.cache
        for seq_id, tokens in work:
            seq = self._sequence(seq_id)
            start = len(seq)
            seq.token_ids.extend(tokens)
            assert cache.allocate(seq, len(seq))
            chunks.append(ScheduledChunk(seq, start, len(tokens), sample=True))
        plan = StepPlan(chunks, zero_slots=cache.take_fresh_slots())
        runner = self.engine.runner
        runner.states.zero(plan.zero_slots)
        batch = runner.prepare(plan)
        hidden = self.model(batch)
        for seq in self.seqs.values():
            seq.num_computed_tokens = seq.num_scheduled_tokens = len(seq)
        return self.model.compute_logits(hidden[batch.logits_indices])
