"""The armillary side of a plugin test: the plugin registered by hand, an engine on the CPU, steps a test picks, logits caught."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from armillary.config import EngineConfig
from armillary.engine import LLMEngine
from armillary.forward_batch import ForwardBatch, LayerCache
from armillary.registry import PluginRegistry
from armillary.sampling_params import SamplingParams
from armillary.sequence import Sequence
from armillary.step_plan import ScheduledChunk, StepPlan


def plugin_registry(hooks: Any, name: str, distribution: str = "") -> PluginRegistry:
    """A registry holding only the plugin whose hook module is ``hooks`` (no entry-point autoload)."""
    registry = PluginRegistry()
    registry.register(hooks, name, distribution=distribution)
    return registry


def cpu_engine(model_dir: Path, registry: PluginRegistry, dtype: str = "float32", max_model_len: int = 512,
               **engine_args: Any) -> LLMEngine:
    """The engine on ``model_dir`` on the CPU; ``engine_args`` are ``EngineConfig`` fields."""
    config = EngineConfig(model=str(model_dir), dtype=dtype, device="cpu", max_model_len=max_model_len, **engine_args)
    return LLMEngine(config, registry=registry)


def greedy_params(max_tokens: int) -> SamplingParams:
    """Greedy sampling of exactly ``max_tokens`` tokens (EOS ignored), as the references are generated."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


class StepHarness:
    """The real engine's model, caches and runner with the steps a test picks instead of the scheduler.

    ``step([(seq_id, new_tokens), ...])`` appends each sequence's new tokens, holds their cache
    positions, runs one packed forward over all chunks in that order and returns each sequence's last
    logits [len(work), V] (every row's with ``all_rows``). A sequence id seen for the first time
    starts a fresh sequence (its recurrent state zeroed).
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.model = engine.model
        self.seqs: dict[int, Sequence] = {}

    def _sequence(self, seq_id: int) -> Sequence:
        if seq_id not in self.seqs:
            self.seqs[seq_id] = Sequence(str(seq_id), 0, [], SamplingParams())
        return self.seqs[seq_id]

    @torch.inference_mode()
    def step(self, work: list[tuple[int, list[int]]], decode_only: bool = False, no_host_lists: bool = False,
             all_rows: bool = False) -> torch.Tensor:
        """``decode_only``: a decode step as a CUDA graph stages it (asserted decode-only, no host lists);
        ``no_host_lists``: any step without them (a captured speculative verify)."""
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
        runner.cache_ops_before(plan)
        batch = runner.prepare(plan)
        if decode_only:
            assert batch.is_decode_only
        if decode_only or no_host_lists:
            batch.query_start_loc_cpu = batch.context_lens_cpu = batch.seq_lens_cpu = None
        hidden = self.model(batch)
        for seq in self.seqs.values():
            seq.num_computed_tokens = seq.num_scheduled_tokens = len(seq)
        return self.model.compute_logits(hidden if all_rows else hidden[batch.logits_indices])


class LogitsRecorder:
    """Records every logits row an engine computes, by wrapping its model's ``compute_logits``."""

    def __init__(self, model) -> None:
        self.rows: list[torch.Tensor] = []
        self.model = model
        self.inner = model.compute_logits

        def record(hidden: torch.Tensor) -> torch.Tensor:
            out = self.inner(hidden)
            self.rows.extend(out.detach().clone())
            return out

        model.compute_logits = record

    def take(self) -> torch.Tensor:
        """The rows recorded since the last ``take``, stacked [N, V]; the record starts empty again."""
        rows = torch.stack(self.rows)
        self.rows.clear()
        return rows

    def close(self) -> None:
        """The model's own ``compute_logits`` back; the recorder lets go of the model (its rows stay)."""
        del self.model.compute_logits
        self.model = self.inner = None  # a recorder kept after close must not keep the weights alive


def run_staggered(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams,
                  every: int = 3) -> list[list[int]]:
    """Requests ``r0``, ``r1``, ... arriving one every ``every`` engine steps (the first before step 0),
    stepped until all finish; each one's output token ids, in prompt order."""
    done: dict[str, list[int]] = {}
    pending, step = list(enumerate(prompts)), 0
    while pending or engine.has_unfinished_requests():
        if pending and step % every == 0:
            i, prompt = pending.pop(0)
            engine.add_request(f"r{i}", prompt, params)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        step += 1
    return [done[f"r{i}"] for i in range(len(prompts))]


def paged_batch(caches: list[LayerCache | None], rows: list[tuple[list[int], list[int], list[int], int]],
                block_size: int) -> ForwardBatch:
    """A ForwardBatch over paged caches (a layer's or a draft head's own test, no engine): ``rows`` per
    sequence (its new token ids, their positions, its block table, the tokens cached before them)."""
    ids = [t for r in rows for t in r[0]]
    pos = [p for r in rows for p in r[1]]
    width = max(len(r[2]) for r in rows)
    tables = torch.tensor([r[2] + [0] * (width - len(r[2])) for r in rows], dtype=torch.int32)
    slots = [r[2][p // block_size] * block_size + p % block_size for r in rows for p in r[1]]
    qsl = [0]
    for r in rows:
        qsl.append(qsl[-1] + len(r[0]))
    ctx = [r[3] for r in rows]
    seq_lens = [c + len(r[0]) for c, r in zip(ctx, rows)]
    return ForwardBatch(
        input_ids=torch.tensor(ids), positions=torch.tensor(pos), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        context_lens=torch.tensor(ctx, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        slot_mapping=torch.tensor(slots), block_tables=tables, state_slots=torch.zeros(len(rows), dtype=torch.long),
        logits_indices=torch.tensor(qsl[1:]) - 1, caches=caches, query_start_loc_cpu=qsl, context_lens_cpu=ctx,
        seq_lens_cpu=seq_lens, is_decode_only=all(len(r[0]) == 1 for r in rows), max_seq_len=max(seq_lens))
