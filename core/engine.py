"""The engine: requests in, one ``schedule -> run -> postprocess`` step at a time, outputs out.

With async scheduling a decode step is launched before the previous step's tokens are read back,
so the host's bookkeeping overlaps the GPU's work.
"""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager

import torch

from armillary.config import EngineConfig
from armillary.cuda_graphs import CUDAGraphDecoder
from armillary.errors import InvalidRequestError
from armillary.kernels import ops
from armillary.memory.block_manager import BlockManager
from armillary.memory.planner import GiB, MemoryPlan, allocate_caches, cuda_cache_budget, plan_memory
from armillary.memory.state_pool import StatePool
from armillary.model_files import checkpoint_dtype
from armillary.model_source import open_model_source
from armillary.model_runner import LaunchedStep, ModelRunner
from armillary.outputs import RequestOutput
from armillary.registry import PluginRegistry, default_registry
from armillary.request_state import RequestState, SeqText
from armillary.sampler import Sampler
from armillary.sampling_params import SamplingParams
from armillary.scheduler import Scheduler
from armillary.sequence import Sequence
from armillary.structured.outputs import StructuredOutputs
from armillary.weights import fill_parameters

log = logging.getLogger("armillary")


@contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


class LLMEngine:
    """Single-threaded; a front end calls ``add_request`` / ``abort_request`` between ``step`` calls."""

    def __init__(self, config: EngineConfig, registry: PluginRegistry | None = None) -> None:
        self.config = config
        self.registry = registry or default_registry()
        self.registry.hook.armillary_startup(config=config)
        ops.set_backend(config.kernel_backend)
        self.source = open_model_source(config.model, config.revision, self.registry, config)
        self.model_path = self.source.path
        self.hf_config = self.source.hf_config()
        self.arch = self.registry.resolve_architecture(list(getattr(self.hf_config, "architectures", None) or []))
        model_cls = self.arch.load()
        self.device = config.torch_device()
        self.dtype = config.torch_dtype(checkpoint_dtype(self.hf_config))
        self.generation_defaults = self.source.generation_defaults()
        self.tokenizer = self._load_tokenizer()
        self.max_model_len = self._max_model_len(model_cls)

        with torch.device(self.device), _default_dtype(self.dtype):
            self.model = model_cls(self.hf_config)
        if config.load_format == "dummy":
            self._init_dummy_weights()
        else:
            fill_parameters(self.model, self.source.iter_weights(), str(self.model_path))
        self.model.eval()
        log.info("weights loaded: %s (%s) on %s as %s", self.model_path, self.arch.name, self.device, self.dtype)

        layout = model_cls.cache_layout(self.hf_config)
        if self.device.type == "cuda":
            self._profile_run(layout)
        self.plan = self._plan_memory(layout)
        caches, state_tensors = allocate_caches(layout, self.plan, self.dtype, self.device)
        log.info("memory plan: %s", self.plan.describe())
        # the last block and the last slot are scratch space for CUDA-graph padding rows, never handed out
        scratch_block, scratch_slot = self.plan.num_blocks - 1, self.plan.num_slots - 1
        self.blocks = BlockManager(scratch_block, config.block_size)
        self.states = StatePool(scratch_slot, state_tensors) if state_tensors else None
        self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens, self.blocks, self.states)
        graphs = None
        if self.device.type == "cuda" and not config.enforce_eager and config.kernel_backend == "auto":
            max_blocks = -(-self.max_model_len // config.block_size)
            graphs = CUDAGraphDecoder(self.model, caches, min(config.max_num_seqs, config.max_graph_batch),
                                      max_blocks, config.block_size, scratch_block, scratch_slot, self.device)
            graphs.capture()
        self.eos_token_ids = self._eos_token_ids()
        self.structured = StructuredOutputs(self.tokenizer, self.model.text_config(self.hf_config).vocab_size,
                                            self.eos_token_ids)
        self.runner = ModelRunner(self.model, caches, config.block_size, self.device, Sampler(seed=config.seed),
                                  graphs, structured=self.structured)
        self.requests: dict[str, RequestState] = {}
        self.async_scheduling = config.async_scheduling if config.async_scheduling is not None \
            else self.device.type == "cuda"
        self._inflight: LaunchedStep | None = None  # a launched step whose tokens are not read yet
        self.num_async_steps = 0  # steps launched before their inputs were on the host

    # ---- construction helpers

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

    def _eos_token_ids(self) -> tuple[int, ...]:
        ids: list[int] = []
        gen_eos = self.generation_defaults.get("eos_token_id")
        for source in (gen_eos, getattr(self.model.text_config(self.hf_config), "eos_token_id", None)):
            if source is None:
                continue
            ids.extend(source if isinstance(source, list) else [source])
        if self.tokenizer is not None:
            ids.extend(self.tokenizer.eos_token_ids)
        return tuple(dict.fromkeys(int(i) for i in ids))

    def _init_dummy_weights(self) -> None:
        gen = torch.Generator(device=self.device).manual_seed(self.config.seed)
        with torch.no_grad():
            for p in self.model.parameters():
                if p.is_floating_point():
                    p.uniform_(-0.02, 0.02, generator=gen)

    def _profile_run(self, layout) -> None:
        """One full-budget prefill on throw-away caches, so the planner sees the activation peak."""
        cfg = self.config
        n = min(cfg.max_num_batched_tokens, self.max_model_len)
        blocks = -(-n // cfg.block_size)
        tmp = MemoryPlan(blocks, cfg.block_size, 1, 0, 0)
        caches, _ = allocate_caches(layout, tmp, self.dtype, self.device)
        runner = ModelRunner(self.model, caches, cfg.block_size, self.device)
        seq = Sequence("profile", 0, [0] * n, SamplingParams(max_tokens=1, temperature=0.0))
        seq.block_table, seq.state_slot, seq.num_new_tokens = list(range(blocks)), 0, n
        runner.run([seq])
        del runner, caches
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    def _plan_memory(self, layout) -> MemoryPlan:
        cfg = self.config
        useful = cfg.max_num_seqs * -(-self.max_model_len // cfg.block_size) + 1  # + the scratch block
        if self.device.type == "cuda":
            budget = cuda_cache_budget(self.device, cfg.gpu_memory_utilization)
        else:
            budget = int(cfg.cpu_kv_cache_space_gb * GiB)
        override = cfg.num_kv_blocks + 1 if cfg.num_kv_blocks is not None else None
        return plan_memory(layout, budget_bytes=budget, block_size=cfg.block_size, num_slots=cfg.max_num_seqs + 1,
                           dtype=self.dtype, max_blocks_useful=useful, num_blocks_override=override)

    # ---- requests

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None) -> None:
        """Queue a request; raises ``InvalidRequestError`` without holding anything on bad input."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        text, ids = self._tokenize(prompt)
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.model.text_config(self.hf_config).vocab_size
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
        capacity = self.blocks.num_blocks * self.blocks.block_size
        if len(ids) + max_tokens > capacity:
            raise InvalidRequestError(
                f"the request needs {len(ids) + max_tokens} tokens of KV cache; the pool holds {capacity}")
        grammar = self.structured.compile(params.structured) if params.structured is not None else None
        seqs, texts = [], []
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            seq = Sequence(request_id, i, ids, params, self.eos_token_ids, seed=seed, arrival=time.time(),
                           max_tokens=max_tokens)
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

    # ---- the step

    def step(self) -> list[RequestOutput]:
        """Run one step and return the outputs it finished.

        With async scheduling, a decode step whose sequences all continue is followed at once by the
        next one, fed the tokens still on the device, before this step's tokens are read back: the
        host's bookkeeping then overlaps the GPU's work. A sequence that ends on the awaited token
        (stop token, stop string) had one token too many launched; that token is dropped.
        """
        step = self._inflight
        if step is None:
            seqs = self.scheduler.schedule()
            if not seqs:
                return []
            step = self._launch(seqs)
        self._inflight = self._launch_continuation(step)
        outputs = self._collect(step)
        if self._inflight is not None and all(s.is_finished for s in self._inflight.seqs):
            self._inflight = None  # its results concern no live sequence; the GPU finishes it unobserved
        return outputs

    def _launch(self, seqs: list[Sequence], input_tokens: torch.Tensor | None = None) -> LaunchedStep:
        step = self.runner.launch(seqs, input_tokens)
        for seq in seqs:
            seq.num_computed_tokens += seq.num_new_tokens
            seq.num_new_tokens = 0
        return step

    def _launch_continuation(self, step: LaunchedStep) -> LaunchedStep | None:
        """The next decode step of ``step``'s sequences, launched before ``step``'s tokens are read,
        or None when the next step needs them on the host (or is not a plain continuation)."""
        if not self.async_scheduling or self.scheduler.waiting or not step.sampled or len(self.structured):
            return None
        if len(step.sampled) != len(self.scheduler.running) or any(s.is_finished for s in step.sampled):
            return None  # some running sequence is mid-prefill, or one ended meanwhile
        rows = []
        for i, seq in enumerate(step.sampled):
            p = seq.params
            if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 \
                    or seq.num_output_tokens < p.min_tokens:
                return None  # the sampler needs the awaited token on the host
            if seq.num_output_tokens + 1 < seq.max_tokens:  # else the awaited token is its last
                rows.append(i)
        seqs = [step.sampled[i] for i in rows]
        if not seqs or not self.scheduler.schedule_continuation(seqs):
            return None
        tokens = step.output.token_ids
        if len(rows) < len(step.sampled):
            tokens = tokens[torch.tensor(rows, device=tokens.device)]
        self.num_async_steps += 1
        return self._launch(seqs, tokens)

    def _collect(self, step: LaunchedStep) -> list[RequestOutput]:
        """Wait for ``step``'s tokens and append them; sequences that ended meanwhile are skipped."""
        out = step.wait()
        touched: dict[str, RequestState] = {}
        if out is not None:
            token_ids = out.token_ids.tolist()
            logprobs = out.logprobs.tolist() if out.logprobs is not None else None
            top_ids = out.top_ids.tolist() if out.top_ids is not None else None
            top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
            now = time.time()
            for row, seq in enumerate(step.sampled):
                if seq.is_finished:  # aborted, or ended on the token before (async scheduling)
                    continue
                state = self.requests[seq.request_id]
                k = seq.params.logprobs
                if k is not None:
                    top = list(zip(top_ids[row][:k], top_lps[row][:k])) if k else []
                    seq.logprobs.append((logprobs[row], top))
                self._append(seq, token_ids[row], state.texts[seq.index])
                state.metrics.setdefault("first_token_time", now)
                touched[seq.request_id] = state
        outputs = []
        for rid, state in touched.items():
            if state.finished:
                state.metrics["finished_time"] = time.time()
                del self.requests[rid]
            outputs.append(state.output())
        return outputs

    def _append(self, seq: Sequence, token: int, text: SeqText) -> None:
        seq.token_ids.append(token)
        grammar_ended = self.structured.advance(seq, token)  # it took a stop token: nothing may follow
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens:
            # a stop or end-of-sequence token ends the text without adding its own (as vLLM does)
            if token in p.stop_token_ids:
                seq.stop_reason = token
                self.scheduler.finish(seq, "stop")
            elif not p.ignore_eos and token in seq.eos_token_ids:
                self.scheduler.finish(seq, "stop")
        if not seq.is_finished:
            stop = text.add(token)
            if seq.num_output_tokens < p.min_tokens:
                return
            if stop is not None:
                seq.stop_reason = stop
                self.scheduler.finish(seq, "stop")
            elif grammar_ended:
                self.scheduler.finish(seq, "stop")
            elif seq.num_output_tokens >= seq.max_tokens:
                self.scheduler.finish(seq, "length")
        if seq.is_finished:
            text.finish()
            self.structured.release(seq)

    def stats(self) -> dict:
        return {
            "num_waiting": len(self.scheduler.waiting),
            "num_running": len(self.scheduler.running),
            "kv_blocks_total": self.blocks.num_blocks,
            "kv_blocks_used": self.blocks.num_used,
            "state_slots_total": self.states.num_slots if self.states else 0,
            "state_slots_used": self.states.num_used if self.states else 0,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_async_steps": self.num_async_steps,
            "prefix_cache_hit_rate": 0.0,
        }
