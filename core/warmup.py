"""Start-up warm-up: every prefill size, sampler path and a grammar run once, so no request waits on a compile.

Triton compiles a kernel per constexpr set and per integer-argument class (== 1, divisible by
16, other), and the tuning tables pick block sizes by the power-of-two bucket of the token
count; a request that meets a variant first pays its compile (seconds on a cold cache). So at
start-up the engine runs, through its real step path: a prefill of every bucket up to the token
budget (the bucket, a multiple of 16, and one token less, which is not); the same chunks over
cached context (a long prompt's later chunks, prefix-cache hits; GDN chunks from a state), short
chunks also over 32K tokens (attention splits its keys there); a mixed decode + prefill step and
a two-prompt step; the sampler's paths (greedy, temperature with top-k / top-p / min-p,
penalties, per-request seeds, logprobs, min_tokens); the chat template (its compile is cached);
one tiny JSON schema through xgrammar. Decode CUDA graphs are captured before (``init_caches``).
On the CPU only one small size runs (nothing compiles there; the rest would cost test time).

Compiled kernels go to a persistent cache: ``TRITON_CACHE_DIR`` when set, else
``~/.cache/armillary/triton`` (``configure_compile_cache``), so the next start loads them.
Everything a warm-up request held is freed (checked), and the engine then rebuilds its
host-side bookkeeping and its sampler, so counters, prefix-cache entries and random streams
are as if it had never run.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from armillary.errors import InvalidRequestError
from armillary.sampler import Sampler
from armillary.sampling_params import SamplingParams
from armillary.sequence import Sequence
from armillary.step_plan import ScheduledChunk, StepPlan
from armillary.structured.spec import StructuredSpec

if TYPE_CHECKING:
    from armillary.engine import LLMEngine

log = logging.getLogger("armillary")

_LONG_CONTEXT = 32768  # the context short chunks are also warmed over (attention's key splits saturate by then)
_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 4}},
           "required": ["a"]}


def default_compile_cache_dir() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return Path(xdg).expanduser() / "armillary" / "triton"


def configure_compile_cache() -> str:
    """Point Triton's on-disk kernel cache at a stable per-user folder unless ``TRITON_CACHE_DIR``
    is set; returns the folder ("" if it cannot be made). Triton reads the variable when it
    compiles, so this runs before anything compiles."""
    if not os.environ.get("TRITON_CACHE_DIR"):
        folder = default_compile_cache_dir()
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a read-only home: Triton keeps its own default
            log.warning("cannot create the compile cache %s (%s); Triton uses its default", folder, exc)
            return ""
        os.environ["TRITON_CACHE_DIR"] = str(folder)
    return os.environ["TRITON_CACHE_DIR"]


def prefill_sizes(budget: int, limit: int) -> list[int]:
    """Chunk lengths covering every variant a prefill can hit up to ``min(budget, limit)``: 1, and
    per power-of-two bucket ``p`` both ``p`` and ``p - 1``; the top itself and one less."""
    top = max(1, min(budget, limit))
    sizes = {1, top, max(1, top - 1)}
    p = 2
    while p <= top:
        sizes.update((p, p - 1))
        p *= 2
    return sorted(sizes)


@dataclass(slots=True)
class WarmupReport:
    """Seconds per stage, in order; ``skipped``: sizes the engine's pools or limits could not hold."""

    stages: list[tuple[str, float]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


class _Warmer:
    """Drives one engine through the stages: dummy requests through ``add_request`` / ``step``, or
    plans the scheduler would make launched on the worker directly."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.vocab = engine.structured.vocab_size
        self.report = WarmupReport()
        self.num_requests = 0

    def tokens(self, n: int, salt: int = 0) -> list[int]:
        return [(7 + 13 * i + 101 * salt) % self.vocab for i in range(n)]

    def sync(self) -> None:
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)

    def stage(self, name: str, run) -> None:
        start = time.perf_counter()
        ran = run()
        self.sync()
        took = time.perf_counter() - start
        if ran is False:
            self.report.skipped.append(name)
            log.debug("warm-up: %s skipped (does not fit this engine)", name)
            return
        self.report.stages.append((name, took))
        log.info("warm-up: %s %.2f s", name, took)

    def add(self, prompt: list[int], params: SamplingParams) -> bool:
        self.num_requests += 1
        try:
            self.engine.add_request(f"warmup-{self.num_requests}", prompt, params)
        except InvalidRequestError:
            return False  # over this engine's context or pool (tiny test engines)
        return True

    def drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def run(self, requests: list[tuple[list[int], SamplingParams]]) -> bool:
        added = [self.add(p, params) for p, params in requests]
        self.drain()
        return any(added)

    # ---- stages

    def fresh_prefill(self, sizes: list[int]) -> bool:
        greedy = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        ran = [self.run([(self.tokens(n, salt=n), greedy)]) for n in sizes]  # one by one: each its own step
        return any(ran)

    def prefill_after_context(self, n: int, context: int) -> bool:
        """A chunk of ``n`` tokens over ``context`` cached ones, launched as the scheduler would plan it."""
        eng = self.engine
        seq = Sequence("warmup-context", 0, self.tokens(context + n, salt=3),
                       SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        if not eng.cache.allocate(seq, context + n):
            return False
        try:
            plan = StepPlan([ScheduledChunk(seq, context, n, sample=True)], zero_slots=eng.cache.take_fresh_slots())
            eng.worker.launch(plan).wait()
        finally:
            eng.cache.free(seq)
        return True

    def mixed_step(self, n: int) -> bool:
        """One sequence decoding while another prefills ``n`` tokens, then two prompts in one step."""
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        if not self.add(self.tokens(5, salt=5), params):
            return False
        self.engine.step()  # its prefill; its decodes now share steps with the next prompt
        self.add(self.tokens(n, salt=6), params)
        self.drain()
        return self.run([(self.tokens(3, salt=7), params), (self.tokens(max(1, n // 2), salt=8), params)])

    def sampler_paths(self) -> bool:
        base = dict(max_tokens=3, ignore_eos=True)
        mixed = [SamplingParams(temperature=0.0, **base),
                 SamplingParams(temperature=0.8, top_p=0.9, top_k=20, **base),
                 SamplingParams(temperature=1.0, min_p=0.1, repetition_penalty=1.1, frequency_penalty=0.2,
                                presence_penalty=0.3, logprobs=2, **base),
                 SamplingParams(temperature=0.7, seed=1, **base),
                 SamplingParams(temperature=1.0, min_tokens=2, stop_token_ids=[0], max_tokens=3)]
        ran = self.run([(self.tokens(6, salt=10 + i), p) for i, p in enumerate(mixed)])
        only_sampled = [SamplingParams(temperature=1.0, **base), SamplingParams(temperature=0.6, top_k=5, **base)]
        return self.run([(self.tokens(4, salt=20 + i), p) for i, p in enumerate(only_sampled)]) or ran

    def chat_template(self) -> bool:
        """Render a one-message conversation: the template's compile is cached for the first chat request."""
        tok = self.engine.tokenizer
        if tok is None or not getattr(tok, "chat_templates", None):
            return False
        try:
            text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
        except Exception as exc:  # a template that needs more than one user message: a request will say so
            log.warning("warm-up: the chat template did not render a one-message conversation: %s", exc)
            return False
        tok.encode(text)
        return True

    def grammar(self) -> bool:
        if self.engine.tokenizer is None:
            return False  # structured output needs a tokenizer
        spec = StructuredSpec.json_schema(_SCHEMA)
        try:
            self.engine.structured.compile(spec)  # cached: the request below finds it compiled
        except Exception as exc:  # this tokenizer's vocabulary defeats xgrammar: such requests will say so
            log.warning("warm-up: no grammar warm-up, compiling a JSON schema failed: %s", exc)
            return False
        params = SamplingParams(temperature=1.0, seed=0, max_tokens=8, structured=spec)
        return self.run([(self.tokens(6, salt=30), params)])


def warm_up(engine: LLMEngine, sizes: list[int] | None = None) -> WarmupReport:
    """Run the warm-up stages on ``engine`` (built up to its caches and bookkeeping) and check that
    nothing stays held; the engine then rebuilds its bookkeeping. ``sizes``: prefill chunk lengths
    (default: ``prefill_sizes`` on CUDA, one small size on the CPU)."""
    cfg = engine.config
    budget = engine.scheduler.max_num_batched_tokens  # the budget the scheduler splits prompts by
    limit = engine.max_model_len - 1
    if sizes is None:
        on_gpu = engine.device.type == "cuda"
        sizes = prefill_sizes(budget, limit) if on_gpu else [min(8, limit)]
    w = _Warmer(engine)
    start = time.perf_counter()
    buckets: dict[int, list[int]] = {}
    for n in sizes:
        buckets.setdefault(1 << max(0, n - 1).bit_length(), []).append(n)
    for _, group in sorted(buckets.items()):
        w.stage(f"prefill {'/'.join(map(str, group))} tokens", lambda g=group: w.fresh_prefill(g))
    bs = cfg.block_size
    for n in sorted(sizes):
        room = (limit - n) // bs * bs
        # a long prompt's second chunk; short chunks also over a long context (attention splits its keys)
        contexts = {min(budget // bs * bs, room)} | ({min(_LONG_CONTEXT, room)} if n <= 64 else set())
        for c in sorted(x for x in contexts if x >= bs):
            w.stage(f"prefill {n} tokens after {c}", lambda n=n, c=c: w.prefill_after_context(n, c))
    w.stage("mixed decode + prefill steps", lambda: w.mixed_step(min(max(sizes), 37)))
    w.stage("sampler paths", w.sampler_paths)
    w.stage("chat template", w.chat_template)
    w.stage("grammar mask (JSON schema)", w.grammar)
    _check_released(engine)
    engine.runner.sampler = Sampler(seed=cfg.seed)  # the seeded stream starts where it would have
    took = time.perf_counter() - start
    log.info("warm-up: %d stages in %.1f s (Triton cache %s)", len(w.report.stages), took,
             os.environ.get("TRITON_CACHE_DIR"))
    return w.report


def _check_released(engine: LLMEngine) -> None:
    engine.cache.check_accounting(list(engine.scheduler.running))
    if engine.requests or engine.has_unfinished_requests():
        raise RuntimeError(f"warm-up left requests behind: {sorted(engine.requests)}")


def forget_warm_requests(engine: LLMEngine) -> None:
    """After warm-up requests sent from outside (the server's own routes): check that none is left and
    nothing is held, then rebuild the host-side bookkeeping and the sampler as ``warm_up`` leaves them,
    so counters, prefix-cache entries and random streams are as if those requests had never run."""
    _check_released(engine)
    engine._init_bookkeeping()
    engine.runner.sampler = Sampler(seed=engine.config.seed)
