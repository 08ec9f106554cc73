"""Prometheus metrics: HTTP requests by status, tokens, latency histograms, engine pool gauges; the throughput log line."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

log = logging.getLogger("armillary.server")

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                0.5, 0.75, 1.0, 2.5)

# The routes a client may call; anything else is counted as "other" to bound label cardinality.
KNOWN_ROUTES = frozenset({
    "/v1/models", "/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens",
    "/health", "/metrics", "/tokenize", "/detokenize", "/version",
})


class _EngineCollector(Collector):
    """Reads the engine's last stats snapshot at scrape time."""

    def __init__(self, stats: Callable[[], dict]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily]:
        s = self._stats()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"armillary_{name}", doc, value=float(value))

        blocks_total = s.get("kv_blocks_total", 0)
        blocks_used = s.get("kv_blocks_used", 0)
        slots_total = s.get("state_slots_total", 0)
        slots_used = s.get("state_slots_used", 0)
        yield gauge("num_requests_waiting", "Requests the scheduler has not started", s.get("num_waiting", 0))
        yield gauge("num_requests_running", "Requests the scheduler is running", s.get("num_running", 0))
        yield gauge("queue_depth", "Requests waiting for their first output (what --max-queue-size bounds)",
                    s.get("num_waiting_first_output", 0))
        yield gauge("kv_blocks_total", "Paged KV cache blocks in the pool", blocks_total)
        yield gauge("kv_blocks_used", "Paged KV cache blocks held", blocks_used)
        yield gauge("kv_cache_usage_ratio", "Fraction of KV blocks held", blocks_used / blocks_total if blocks_total else 0)
        yield gauge("state_slots_total", "Recurrent-state slots in the pool", slots_total)
        yield gauge("state_slots_used", "Recurrent-state slots held", slots_used)
        yield gauge("state_slots_usage_ratio", "Fraction of recurrent-state slots held",
                    slots_used / slots_total if slots_total else 0)
        yield gauge("prefix_cache_hit_rate", "Prompt tokens the prefix cache served over prompt tokens admitted",
                    s.get("prefix_cache_hit_rate", 0.0))
        yield gauge("prefix_cache_hit_tokens", "Prompt tokens the prefix cache served so far",
                    s.get("prefix_cache_hit_tokens", 0))
        yield gauge("prefix_cache_prompt_tokens", "Prompt tokens admitted so far (first admissions)",
                    s.get("prefix_cache_prompt_tokens", 0))
        yield gauge("kv_blocks_cached", "KV blocks nobody holds that keep a cached prefix (evicted on demand)",
                    s.get("kv_blocks_cached", 0))
        yield gauge("state_snapshots_cached", "Recurrent-state snapshots the prefix cache keeps",
                    s.get("state_snapshots_cached", 0))
        yield gauge("state_snapshots_used", "Recurrent-state snapshot rows taken (the cached ones included)",
                    s.get("state_snapshots_used", 0))
        yield gauge("state_slots_held", "Ended sequences' recurrent states not yet copied out",
                    s.get("state_slots_held", 0))
        if s.get("startup_seconds") is not None:
            yield gauge("startup_seconds", "Seconds the engine took to start (weights, caches, graphs, warm-up)",
                        s["startup_seconds"])
        if "num_preemptions" in s:
            yield gauge("num_preemptions", "Sequences preempted so far", s["num_preemptions"])
        if "spec_acceptance_rate" in s:  # speculation on
            yield gauge("spec_decode_acceptance_rate", "Accepted drafts over drafted tokens", s["spec_acceptance_rate"])
            yield gauge("spec_decode_mean_accepted_length", "Drafts accepted per verified sequence step",
                        s["spec_mean_accepted_length"])
            yield gauge("spec_decode_tokens_per_step", "Tokens emitted per verified sequence step",
                        s["spec_tokens_per_step"])
            yield gauge("spec_decode_num_draft_tokens", "Draft tokens verified so far", s["num_draft_tokens"])
            yield gauge("spec_decode_num_accepted_tokens", "Draft tokens accepted so far", s["num_accepted_tokens"])


class ServerMetrics:
    """One Prometheus registry per server (so tests can build several apps in one process)."""

    def __init__(self, stats: Callable[[], dict]) -> None:
        self.registry = CollectorRegistry()
        self.http_requests = Counter("armillary_http_requests", "HTTP requests by route and status code",
                                     ["route", "status"], registry=self.registry)
        self.requests_finished = Counter("armillary_requests_finished", "Generation requests by finish reason",
                                         ["finish_reason"], registry=self.registry)
        self.prompt_tokens = Counter("armillary_prompt_tokens", "Prompt tokens prefilled", registry=self.registry)
        self.generation_tokens = Counter("armillary_generation_tokens", "Tokens generated", registry=self.registry)
        self.time_to_first_token = Histogram("armillary_time_to_first_token_seconds",
                                             "From submission to the first output", buckets=_TTFT_BUCKETS,
                                             registry=self.registry)
        self.inter_token_latency = Histogram("armillary_inter_token_latency_seconds",
                                             "Between consecutive output tokens of one sequence",
                                             buckets=_ITL_BUCKETS, registry=self.registry)
        self.registry.register(_EngineCollector(stats))
        self.stats = stats
        self.total_prompt_tokens = 0  # plain totals for the throughput log (event-loop side)
        self.total_generation_tokens = 0

    # ---- AsyncEngine observer interface

    def first_output(self, seconds: float, prompt_tokens: int) -> None:
        self.time_to_first_token.observe(seconds)
        self.prompt_tokens.inc(prompt_tokens)
        self.total_prompt_tokens += prompt_tokens

    def inter_token(self, seconds: float, tokens: int) -> None:
        for _ in range(tokens):
            self.inter_token_latency.observe(seconds / tokens)

    def tokens_generated(self, count: int) -> None:
        self.generation_tokens.inc(count)
        self.total_generation_tokens += count

    def request_finished(self, reason: str) -> None:
        self.requests_finished.labels(finish_reason=reason).inc()

    # ---- HTTP

    def http_request(self, path: str, status: int) -> None:
        route = path if path in KNOWN_ROUTES or path.startswith("/v1/models/") else "other"
        if route.startswith("/v1/models/"):
            route = "/v1/models/{model}"
        self.http_requests.labels(route=route, status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ThroughputLog:
    """Every ``interval`` seconds while the server is busy, one line as vLLM logs it: prompt and
    generation tokens per second over the interval, running / waiting requests, KV cache usage."""

    def __init__(self, metrics: ServerMetrics, interval: float = 10.0) -> None:
        self.metrics = metrics
        self.interval = interval
        self._last = (time.monotonic(), 0, 0)

    def line(self, now: float | None = None) -> str | None:
        """The line for the interval ending ``now``, or None when nothing ran in it."""
        now = time.monotonic() if now is None else now
        then, prompt0, gen0 = self._last
        m = self.metrics
        prompt, gen = m.total_prompt_tokens - prompt0, m.total_generation_tokens - gen0
        self._last = (now, m.total_prompt_tokens, m.total_generation_tokens)
        s = m.stats()
        running, waiting = s.get("num_running", 0), s.get("num_waiting", 0)
        if not (prompt or gen or running or waiting):
            return None
        elapsed = max(now - then, 1e-9)
        blocks, used = s.get("kv_blocks_total", 0), s.get("kv_blocks_used", 0)
        text = (f"throughput: prompt {prompt / elapsed:.1f} tokens/s, generation {gen / elapsed:.1f} tokens/s; "
                f"running {running}, waiting {waiting}; KV cache {100 * used / blocks if blocks else 0:.1f}% used "
                f"({used}/{blocks} blocks)")
        if s.get("state_slots_total"):
            text += f", state slots {s.get('state_slots_used', 0)}/{s['state_slots_total']}"
        return text

    async def run(self) -> None:
        """Log forever (cancel the task to stop)."""
        self._last = (time.monotonic(), self.metrics.total_prompt_tokens, self.metrics.total_generation_tokens)
        while True:
            await asyncio.sleep(self.interval)
            text = self.line()
            if text is not None:
                log.info("%s", text)
