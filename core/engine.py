"""The engine: requests in, one ``schedule -> run -> postprocess`` step at a time, outputs out.

With async scheduling a decode step is launched before the previous step's tokens are read back,
so the host's bookkeeping overlaps the GPU's work.
"""
from __future__ import annotations

import gc
import logging
import time

import torch

from armillary.config import EngineConfig
from armillary.errors import InvalidRequestError
from armillary.kernels import ops
from armillary.kernels.dispatch import resolve_dispatch
from armillary.layers.quantization import resolve_quant_config
from armillary.layers.quantization.kv_cache import fp8_kv_layout
from armillary.memory.coordinator import CacheCoordinator
from armillary.memory.planner import MemoryPlan, auto_snapshot_rows, blocks_per_sequence, bytes_per_slot, plan_memory
from armillary.model_files import checkpoint_dtype
from armillary.model_source import open_model_source
from armillary.model_runner import LaunchedStep
from armillary.outputs import RequestOutput
from armillary.parallel import use_parallel
from armillary.registry import PluginRegistry, default_registry
from armillary.request_state import RequestState, SeqText
from armillary.sampling_params import SamplingParams
from armillary.scheduler import Scheduler
from armillary.scheduling_policy import build_policy
from armillary.sequence import Sequence
from armillary.structured.outputs import StructuredOutputs
from armillary.thinking_budget import ThinkingBudgets
from armillary.warmup import configure_compile_cache, warm_up
from armillary.worker import ModelWorker, Worker

log = logging.getLogger("armillary")


class LLMEngine:
    """Single-threaded; a front end calls ``add_request`` / ``abort_request`` between ``step`` calls.

    The engine owns requests, the tokenizer, the scheduler and the cache coordinator (host-side
    bookkeeping); a ``Worker`` owns the model and every device tensor. One step is
    ``plan = scheduler.schedule()``, ``worker.launch(plan).wait()``,
    ``scheduler.update_from_output(plan, output)``.
    """

    def __init__(self, config: EngineConfig, registry: PluginRegistry | None = None) -> None:
        started = time.perf_counter()
        config.validate()
        self.config = config
        configure_compile_cache()  # before anything compiles: Triton's cache persists across starts
        self.registry = registry or default_registry()
        self.registry.hook.armillary_startup(config=config)
        self.source = open_model_source(config.model, config.revision, self.registry, config)
        self.model_path = self.source.path
        self.hf_config = self.source.hf_config()
        self.arch = self.registry.resolve_architecture(list(getattr(self.hf_config, "architectures", None) or []))
        model_cls = self.arch.load()
        self.device = config.torch_device()
        config.resolve_token_budget(self.device)
        self.dtype = config.torch_dtype(checkpoint_dtype(self.hf_config))
        self.kernels = resolve_dispatch(self.registry, self.arch.name, self.device, config.kernel_backend)
        ops.install(self.kernels)
        log.info("kernel dispatch for %s:\n  %s", self.kernels.header(), "\n  ".join(self.kernels.describe()))
        self.generation_defaults = self.source.generation_defaults()
        self.tokenizer = self._load_tokenizer()
        self.max_model_len = self._max_model_len(model_cls)
        text_config = model_cls.text_config(self.hf_config)
        self.eos_token_ids = self._eos_token_ids(text_config)
        self.structured = StructuredOutputs(self.tokenizer, text_config.vocab_size, self.eos_token_ids)
        self.thinking = ThinkingBudgets(self.registry, self.arch, self.tokenizer)

        quant = resolve_quant_config(self.hf_config, self.registry, config.quantization)
        self.worker: Worker = self._make_worker(model_cls, quant)
        self.worker.load_model()
        log.info("weights loaded: %s (%s) on %s as %s", self.model_path, self.arch.name, self.device, self.dtype)
        with use_parallel(self.worker.parallel):  # each rank's caches hold its shard of the heads
            layout = fp8_kv_layout(model_cls.cache_layout(self.hf_config), config.kv_cache_dtype,
                                   config.kv_high_precision_layers)
        self.num_drafts = self._num_drafts(model_cls)
        self.snapshots_inside_chunks = bool(getattr(model_cls, "snapshots_inside_chunks", False))
        main_layers = len(layout)
        if self.num_drafts:
            layout = layout + model_cls.draft_cache_layout(self.hf_config)  # the draft head's own caches
        self.plan = self._plan_memory(layout, self.worker.cache_budget(layout))
        self.worker.init_caches(layout, self.plan, num_drafts=self.num_drafts, main_layers=main_layers)
        self.worker.apply_kv_scales(layout, config.fp8_kv_calibration_tokens, text_config.vocab_size,
                                    config.block_size, self.dtype)
        log.info("memory plan: %s", self.plan.describe())
        self._init_bookkeeping()
        if config.warmup:
            warm_up(self)  # every prefill size, sampler path and a grammar once: kernels compiled and cached
            self._init_bookkeeping()  # and nothing of it left: requests, counters, prefix-cache entries
        self.startup_seconds = time.perf_counter() - started
        log.info("start-up: %.1f s", self.startup_seconds)
        gc.collect()
        gc.freeze()  # torch's and the model's objects out of the collector: no 100 ms pauses inside steps

    def _init_bookkeeping(self) -> None:
        """Fresh host-side state: coordinator (every block and slot free), scheduler, requests, counters."""
        config = self.config
        self.cache = CacheCoordinator.from_plan(self.plan, prefix_caching=config.enable_prefix_caching,
                                                checkpoint_interval=config.state_checkpoint_interval)
        self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens, self.cache, self._check_token,
                                   num_drafts=self.num_drafts, spec_row=self.plan.spec_row,
                                   policy=build_policy(config.scheduling_policy, config.tbt_deadline_ms),
                                   snapshots_inside_chunks=self.snapshots_inside_chunks)
        self.requests: dict[str, RequestState] = {}
        # speculation reads each step's drafts on the host before planning the next one
        # and with other ranks, which read each step's input tokens from the plan rank 0 sends them
        self.async_scheduling = not self.num_drafts and config.world_size == 1 and (
            config.async_scheduling if config.async_scheduling is not None else self.device.type == "cuda")
        self.spec_stats = {"num_verify_steps": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                           "num_emitted_tokens": 0}
        self._inflight: LaunchedStep | None = None  # a launched step whose tokens are not read yet
        self._inflight_started = 0.0  # perf_counter when it was launched
        self._last_step_done = 0.0  # perf_counter when the latest step's tokens were read
        self.num_async_steps = 0  # steps launched before their inputs were on the host

    def shutdown(self) -> None:
        """Give back the weights, caches and graphs, so another engine fits in this process; the engine
        is unusable after. Start-up's ``gc.freeze`` parked the engine's reference cycles: unfreeze first."""
        self._inflight = None
        self.requests.clear()
        self.worker.close()
        del self.worker, self.cache, self.scheduler
        gc.unfreeze()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def model(self):
        return self.worker.model

    @property
    def runner(self):
        return self.worker.runner

    # ---- construction helpers

    def _make_worker(self, model_cls, quant) -> Worker:
        """One ``ModelWorker`` on this device, or with several ranks rank 0's inside ``RankedWorkers``."""
        args = (model_cls, self.hf_config, self.source, self.device, self.dtype, self.max_model_len)
        from armillary.worker.ranks import RankedWorkers, check_launched_world, launched_rank

        launched = launched_rank()
        if launched is not None:  # a launcher's world runs one model over all of it
            check_launched_world(self.config, launched)
        if self.config.world_size == 1:
            return ModelWorker(self.config, *args, quant=quant, structured=self.structured)
        if not model_cls.supports_tensor_parallel:
            raise ValueError(f"tensor_parallel_size {self.config.tensor_parallel_size}, expert_parallel_size "
                             f"{self.config.expert_parallel_size}: the {self.arch.name} model does not shard its "
                             f"layers yet (issue 20); run it on one rank")
        return RankedWorkers(self.config, self.registry, *args, quant=quant, structured=self.structured)

    def _load_tokenizer(self):
        tokenizer = self.source.tokenizer()  # --tokenizer and --chat-template applied by the ConfiguredSource
        if tokenizer is None:
            log.warning("%s has no tokenizer: prompts must be token ids and outputs carry no text", self.model_path)
        return tokenizer

    def _max_model_len(self, model_cls) -> int:
        limit = model_cls.max_model_len(self.hf_config)
        want = self.config.max_model_len
        if want is None:
            if limit is None:
                raise InvalidRequestError("the checkpoint states no context length: pass max_model_len")
            return int(limit)
        if limit is not None and want > limit:
            log.warning("max_model_len %d exceeds the checkpoint's %d", want, limit)
        return int(want)

    def _eos_token_ids(self, text_config) -> tuple[int, ...]:
        ids: list[int] = []
        gen_eos = self.generation_defaults.get("eos_token_id")
        for source in (gen_eos, getattr(text_config, "eos_token_id", None)):
            if source is None:
                continue
            ids.extend(source if isinstance(source, list) else [source])
        if self.tokenizer is not None:
            ids.extend(self.tokenizer.eos_token_ids)
        return tuple(dict.fromkeys(int(i) for i in ids))

    def _num_drafts(self, model_cls) -> int:
        """Drafts per step when speculation is on (0 when off); refuses a checkpoint without a draft head."""
        if not self.config.speculative:
            return 0
        if not model_cls.draft_cache_layout(self.hf_config):
            raise InvalidRequestError(f"--speculative needs a draft head (MTP layers), and {self.model_path} "
                                      f"({self.arch.name}) has none")
        return self.config.num_drafts

    def _plan_memory(self, layout, budget: int) -> MemoryPlan:
        cfg = self.config
        override = cfg.num_kv_blocks + 1 if cfg.num_kv_blocks is not None else None  # + the scratch block
        return plan_memory(layout, budget_bytes=budget, block_size=cfg.block_size, num_slots=cfg.max_num_seqs + 1,
                           dtype=self.dtype, max_model_len=self.max_model_len, max_num_seqs=cfg.max_num_seqs,
                           max_chunk=cfg.max_num_batched_tokens, num_blocks_override=override,
                           num_snapshots=self._num_snapshots(layout, budget), spec_rows_per_slot=self.num_drafts)

    def _num_snapshots(self, layout, budget: int) -> int:
        """State snapshot rows: as configured, or with prefix caching on a hybrid model and none
        configured, the planner's share of the budget (checkpoints and every sequence's end)."""
        cfg = self.config
        per_slot = bytes_per_slot(layout, self.dtype)
        if cfg.num_state_snapshots or not cfg.enable_prefix_caching or not per_slot:
            return cfg.num_state_snapshots
        return auto_snapshot_rows(budget, per_slot, cfg.max_num_seqs, self.max_model_len,
                                  cfg.state_checkpoint_interval)

    # ---- requests

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None) -> None:
        """Queue a request; raises ``InvalidRequestError`` without holding anything on bad input."""
        params = params or SamplingParams()
        if not hasattr(self, "worker"):
            raise RuntimeError("this engine was shut down")
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        text, ids = self._tokenize(prompt)
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.structured.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
        room = self.max_model_len - len(ids)
        if room <= 0:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens, over this model's maximum context length of {self.max_model_len}")
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens > room:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has {len(ids)} "
                f"and {max_tokens} more were requested ({len(ids) + max_tokens} in all)")
        need = blocks_per_sequence(self.plan.paged_groups, self.config.block_size, len(ids) + max_tokens,
                                   self.config.max_num_batched_tokens)
        if need > self.cache.pool.num_usable:
            raise InvalidRequestError(f"the request needs {need} KV blocks ({len(ids) + max_tokens} tokens); "
                                      f"the pool holds {self.cache.pool.num_usable}")
        grammar = self.structured.compile(params.structured) if params.structured is not None else None
        thinking = self.thinking.rule(params, text, ids)
        seqs, texts = [], []
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            seq = Sequence(request_id, i, ids, params, self.eos_token_ids, seed=seed, arrival=time.time(),
                           max_tokens=max_tokens)
            seq.thinking = thinking.start() if thinking is not None else None
            seqs.append(seq)
            if grammar is not None:
                self.structured.attach(seq, grammar)
            texts.append(SeqText(self._detokenizer(ids, params), params.stop, params.include_stop_str_in_output))
        self.requests[request_id] = RequestState(request_id, text, ids, seqs, texts)
        for seq in seqs:
            self.scheduler.add(seq)

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: give prompt token ids")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        return None, [int(t) for t in prompt]

    def _detokenizer(self, prompt_ids: list[int], params: SamplingParams):
        if self.tokenizer is None:
            return None
        from armillary.detokenizer import IncrementalDetokenizer

        return IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens,
                                      prompt_ids=prompt_ids)

    def abort_request(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is None:
            return
        for seq in state.seqs:
            self.scheduler.finish(seq, "abort")
            self.structured.release(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def check_health(self) -> None:
        """Raise ``RankFailed`` when a rank of the model stopped (found without a collective: asked while idle)."""
        self.worker.check_health()

    # ---- the step

    def step(self) -> list[RequestOutput]:
        """Run one step and return the outputs it finished.

        With async scheduling, a decode step whose sequences all continue is followed at once by the
        next one, fed the tokens still on the device, before this step's tokens are read back: the
        host's bookkeeping then overlaps the GPU's work. A sequence that ends on the awaited token
        (stop token, stop string) had one token too many launched; that token is dropped.
        """
        step, started = self._inflight, self._inflight_started
        if step is None:
            started = time.perf_counter()
            plan = self.scheduler.schedule()
            if not plan:
                return []
            step = self.worker.launch(plan)
        self._inflight_started = time.perf_counter()
        self._inflight = self._launch_continuation(step)
        outputs = self._collect(step, started)
        if self._inflight is not None and all(c.seq.is_finished for c in self._inflight.plan.chunks):
            self._inflight = None  # its results concern no live sequence; the GPU finishes it unobserved
        return outputs

    def _launch_continuation(self, step: LaunchedStep) -> LaunchedStep | None:
        """The next decode step of ``step``'s sequences, launched before ``step``'s tokens are read,
        or None when the next step needs them on the host (or is not a plain continuation)."""
        if not self.async_scheduling or self.scheduler.waiting or step.output is None or len(self.structured):
            return None
        chunks = step.plan.chunks
        if len(chunks) != len(self.scheduler.running) or any(not c.sample or c.draft_tokens for c in chunks):
            return None  # some running sequence is mid-prefill, or the step verified drafts
        if any(c.seq.is_finished for c in chunks):
            return None  # one ended meanwhile
        rows = []
        for i, c in enumerate(chunks):
            seq = c.seq
            if seq.sampling_reads_history:
                return None  # a thinking budget near its end needs the awaited token on the host
            # penalties and min_tokens count the awaited token on the device: plan.input_tokens
            if seq.num_output_tokens + 1 < seq.max_tokens:  # else the awaited token is its last
                rows.append(i)
        if not rows:
            return None
        tokens = step.output.token_ids
        if len(rows) < len(chunks):
            tokens = tokens[torch.tensor(rows, device=tokens.device)]
        plan = self.scheduler.schedule_continuation([chunks[i].seq for i in rows], tokens)
        if plan is None:
            return None
        self.num_async_steps += 1
        return self.worker.launch(plan)

    def _collect(self, step: LaunchedStep, started: float) -> list[RequestOutput]:
        """Wait for ``step``'s tokens and hand them to the scheduler; outputs of the requests they touched."""
        out = step.wait()
        done = time.perf_counter()
        # the step's wall time: from its launch, or, queued behind the previous step, from that one's end
        self.scheduler.policy.observe_step(step.plan.num_tokens, done - max(started, self._last_step_done), step.plan)
        self._last_step_done = done
        if out is not None and self.num_drafts:
            self._count_speculation(step.plan, out)
        now = time.time()
        touched: dict[str, RequestState] = {}
        for seq in self.scheduler.update_from_output(step.plan, out):
            state = self.requests[seq.request_id]
            state.metrics.setdefault("first_token_time", now)
            touched[seq.request_id] = state
        outputs = []
        for rid, state in touched.items():
            if state.finished:
                state.metrics["finished_time"] = time.time()
                del self.requests[rid]
            out = state.output()
            out.num_cached_tokens = state.seqs[0].num_cached_tokens or 0  # prompt tokens served by the prefix cache
            outputs.append(out)
        return outputs

    def _count_speculation(self, plan, out) -> None:
        sampled = plan.sampled
        if not sampled or not sampled[0].draft_tokens:
            return
        st = self.spec_stats
        st["num_verify_steps"] += 1
        for chunk, tokens in zip(sampled, out.token_ids):
            st["num_draft_tokens"] += len(chunk.draft_tokens)
            st["num_accepted_tokens"] += len(tokens) - 1
            st["num_emitted_tokens"] += len(tokens)

    def _check_token(self, seq: Sequence, token: int) -> str | None:
        """The scheduler appended ``token`` to ``seq``: text, stop strings, grammar; a finish reason or None."""
        text = self.requests[seq.request_id].texts[seq.index]
        grammar_ended = self.structured.advance(seq, token)  # it took a stop token: nothing may follow
        p = seq.params
        reason = None
        if seq.num_output_tokens >= p.min_tokens:
            # a stop or end-of-sequence token ends the text without adding its own (as vLLM does)
            if token in p.stop_token_ids:
                seq.stop_reason = token
                reason = "stop"
            elif not p.ignore_eos and token in seq.eos_token_ids:
                reason = "stop"
        if reason is None:
            stop = text.add(token)
            if seq.num_output_tokens < p.min_tokens:
                return None
            if stop is not None:
                seq.stop_reason = stop
                reason = "stop"
            elif grammar_ended:
                reason = "stop"
            elif seq.num_output_tokens >= seq.max_tokens:
                reason = "length"
        if reason is not None:
            text.finish()
            self.structured.release(seq)
        return reason

    def single_sequence_batch(self, token_ids: list[int]):
        """(ForwardBatch, plan) prefilling one new sequence over the live caches, for benchmarks and
        checks that call the model directly; the sequence keeps its blocks and slot."""
        from armillary.step_plan import ScheduledChunk, StepPlan

        seq = Sequence("direct", 0, token_ids, SamplingParams(max_tokens=1))
        if not self.cache.allocate(seq, len(seq)):
            raise MemoryError("the caches cannot hold that sequence")
        plan = StepPlan([ScheduledChunk(seq, 0, len(seq), sample=True)], zero_slots=self.cache.take_fresh_slots())
        if self.runner.states is not None:
            self.runner.states.zero(plan.zero_slots)
        return self.runner.prepare(plan), plan

    def stats(self) -> dict:
        return {
            "num_waiting": len(self.scheduler.waiting),
            "num_running": len(self.scheduler.running),
            **self.cache.stats(),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_async_steps": self.num_async_steps,
            "startup_seconds": self.startup_seconds,
            **self._speculation_stats(),
        }

    def _speculation_stats(self) -> dict:
        if not self.num_drafts:
            return {}
        st = self.spec_stats
        seqs_verified = st["num_draft_tokens"] // self.num_drafts
        return {**st,
                "spec_acceptance_rate": st["num_accepted_tokens"] / max(1, st["num_draft_tokens"]),
                "spec_mean_accepted_length": st["num_accepted_tokens"] / max(1, seqs_verified),
                "spec_tokens_per_step": st["num_emitted_tokens"] / max(1, seqs_verified)}
