"""Drive the real engine's model, latent cache and runner with hand-picked steps (the glm_flash plugin registered by hand)."""
from __future__ import annotations

from pathlib import Path

import torch

import armillary_glm_flash.hooks as glm_hooks
from armillary.config import EngineConfig
from armillary.engine import LLMEngine
from armillary.registry import PluginRegistry
from armillary.sampling_params import SamplingParams
from armillary.sequence import Sequence
from armillary.step_plan import ScheduledChunk, StepPlan


def glm_registry() -> PluginRegistry:
    registry = PluginRegistry()
    registry.register(glm_hooks, "glm_flash")
    return registry


def build_engine(model_dir: Path, dtype: str = "float32", **kw) -> LLMEngine:
    config = EngineConfig(model=str(model_dir), dtype=dtype, device="cpu", max_model_len=512, **kw)
    return LLMEngine(config, registry=glm_registry())


class Harness:
    """``step([(seq_id, new_tokens), ...])`` runs one forward and returns each sequence's last logits."""

    def __init__(self, model_dir: Path, dtype: str = "float32", block_size: int = 8) -> None:
        self.engine = build_engine(model_dir, dtype, block_size=block_size, num_kv_blocks=128, max_num_seqs=8)
        self.model = self.engine.model
        self.seqs: dict[int, Sequence] = {}

    def _sequence(self, seq_id: int) -> Sequence:
        if seq_id not in self.seqs:
            self.seqs[seq_id] = Sequence(str(seq_id), 0, [], SamplingParams())
        return self.seqs[seq_id]

    @torch.inference_mode()
    def step(self, work: list[tuple[int, list[int]]], decode_only: bool = False, no_host_lists: bool = False,
             all_rows: bool = False) -> torch.Tensor:
        """``decode_only``: a decode step as a CUDA graph stages it (no host lists); ``no_host_lists``: any step
        without them (a captured speculative verify). Returns each sequence's last logits, or every row's."""
        chunks = []
        cache = self.engine.cache
        for seq_id, tokens in work:
            seq = self._sequence(seq_id)
            start = len(seq)
            seq.token_ids.extend(tokens)
            assert cache.allocate(seq, len(seq))
            chunks.append(ScheduledChunk(seq, start, len(tokens), sample=True))
        batch = self.engine.runner.prepare(StepPlan(chunks))
        if decode_only:
            assert batch.is_decode_only
        if decode_only or no_host_lists:
            batch.query_start_loc_cpu = batch.context_lens_cpu = batch.seq_lens_cpu = None
        hidden = self.model(batch)
        for seq in self.seqs.values():
            seq.num_computed_tokens = seq.num_scheduled_tokens = len(seq)
        return self.model.compute_logits(hidden if all_rows else hidden[batch.logits_indices])
