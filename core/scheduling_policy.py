"""Scheduling policies: the order waiting sequences are admitted in and each step's token budget (fcfs, slai).

The scheduler asks its policy twice per step and tells it once:

- ``budget(running, waiting, limit, room)`` -> ``StepBudget``: the step spends at most ``tokens``
  (never over ``limit``, the configured ``max_num_batched_tokens``); chunks of more than one
  position (prefill) take at most ``prefill`` of them; running sequences' prefill chunks leave
  ``reserved`` of ``prefill`` to the waiting sequences admitted after them (at most ``room`` of
  them may be). Decodes are never held back.
- ``admission_order(waiting, room)``: at most ``room`` waiting sequences, in the order the scheduler
  tries to admit them; it stops at the first that cannot be admitted (cache, budget), so a policy
  never lets a later one overtake a sequence it put ahead.
- ``observe_step(num_tokens, seconds)``: the engine's measured wall time of each completed step
  (with async scheduling, the time between consecutive completed steps).

Everything else (running sequences first, chunk stops, preemption, speculation, async
continuation) stays the scheduler's. ``fcfs`` admits in arrival order with the full budget: the
scheduler as it always was. ``slai`` sizes the prefill part of a step so that the predicted step
time, learned online from ``observe_step`` (``StepTimeModel``), stays under ``tbt_deadline_s``
while any stream decodes; it admits short prompts before long ones and makes a running long
prefill leave room for them, until a sequence has waited ``max_wait_s``: then it goes first, in
arrival order, at full chunk size (no starvation).
"""
from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from armillary.sequence import Sequence


@dataclass(slots=True)
class StepBudget:
    tokens: int  # the step's token budget: decodes and prefill chunks together
    prefill: int  # of which chunks longer than one position may take at most this many
    reserved: int = 0  # of ``prefill``, running sequences' chunks leave this many for admissions


class SchedulingPolicy:
    """The contract of the module docstring; this base class is ``fcfs``."""

    name = "fcfs"

    def budget(self, running: list[Sequence], waiting: Iterable[Sequence], limit: int, room: int) -> StepBudget:
        return StepBudget(limit, limit)

    def admission_order(self, waiting: deque[Sequence], room: int) -> list[Sequence]:
        return [seq for _, seq in zip(range(room), waiting)]  # the queue as it stands (preempted ones in front)

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        pass


class StepTimeModel:
    """Step seconds as a function of the step's token count, learned from measured steps.

    Samples fall into quarter-octave buckets of token count; a bucket's point is the one of its
    latest ``window`` samples at the upper quartile of seconds per token (a compile or a hiccup
    does not move it; later chunks of a long prompt, slower than its first, weigh in). Between
    points the prediction is linear; below the first it is the first point's time; above the last
    it grows in proportion to the tokens; points are made non-decreasing. Each choice errs
    towards a slower step, so a deadline kept by the prediction is kept in fact.
    """

    def __init__(self, window: int = 8) -> None:
        self.window = window
        self._samples: dict[int, deque[tuple[int, float]]] = {}
        self._points: list[tuple[int, float]] | None = None  # (tokens, seconds), ascending; None: stale

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens < 1 or not seconds > 0 or not math.isfinite(seconds):
            return
        bucket = int(4 * math.log2(num_tokens))
        self._samples.setdefault(bucket, deque(maxlen=self.window)).append((num_tokens, seconds))
        self._points = None

    @property
    def num_samples(self) -> int:
        return sum(len(s) for s in self._samples.values())

    def points(self) -> list[tuple[int, float]]:
        if self._points is None:
            points, slowest = [], 0.0
            for bucket in sorted(self._samples):
                ranked = sorted(self._samples[bucket], key=lambda sample: sample[1] / sample[0])
                n, seconds = ranked[int(0.75 * (len(ranked) - 1))]
                slowest = max(slowest, seconds)  # non-decreasing
                points.append((n, slowest))
            self._points = points
        return self._points

    def predict(self, num_tokens: int) -> float | None:
        """Seconds a step of ``num_tokens`` tokens is expected to take; None before any measurement."""
        points = self.points()
        if not points:
            return None
        x0, y0 = points[0]
        if num_tokens <= x0:
            return y0
        for x1, y1 in points[1:]:
            if num_tokens <= x1:
                return y0 + (y1 - y0) * (num_tokens - x0) / (x1 - x0)
            x0, y0 = x1, y1
        return y0 * num_tokens / x0

    def tokens_within(self, seconds: float, most: int) -> int | None:
        """The largest token count in [0, most] predicted to run within ``seconds``; None before any measurement."""
        if not self.points():
            return None
        lo, hi = 0, most  # predict(lo) fits (0 tokens: trivially), search the largest that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.predict(mid) <= seconds:
                lo = mid
            else:
                hi = mid - 1
        return lo


class SlaiPolicy(SchedulingPolicy):
    """Deadline-aware (the module docstring): prefill sized to ``tbt_deadline_s``, short prompts first, aging.

    ``min_prefill_tokens``: prefill tokens a step always offers while any prefill is pending, even
    when the deadline cannot be met (decodes alone too slow), so prompts keep moving.
    ``clock``: the clock ``Sequence.arrival`` is on (``time.time`` in the engine).
    """

    name = "slai"

    def __init__(self, tbt_deadline_s: float, model: StepTimeModel | None = None, max_wait_s: float = 2.0,
                 min_prefill_tokens: int = 64, clock: Callable[[], float] = time.time) -> None:
        self.tbt_deadline_s = tbt_deadline_s
        self.model = model or StepTimeModel()
        self.max_wait_s = max_wait_s
        self.min_prefill_tokens = min_prefill_tokens
        self.clock = clock

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        self.model.observe(num_tokens, seconds)

    def prefill_allowance(self, num_decodes: int, limit: int) -> int:
        """Prefill tokens a step with ``num_decodes`` decodes may add and stay within the deadline."""
        spare = max(0, limit - num_decodes)
        if not num_decodes:
            return spare  # no stream waits on this step: throughput decides
        fits = self.model.tokens_within(self.tbt_deadline_s, limit)
        if fits is None:
            return spare  # nothing measured yet: the first steps teach the model
        return min(spare, max(fits - num_decodes, self.min_prefill_tokens))

    def budget(self, running: list[Sequence], waiting: Iterable[Sequence], limit: int, room: int) -> StepBudget:
        decodes = sum(1 for s in running if s.num_unscheduled_tokens == 1)
        prefill = self.prefill_allowance(decodes, limit)
        tokens = min(limit, decodes + prefill)
        return StepBudget(tokens, prefill, self._reserve(running, waiting, prefill, room))

    def _is_due(self, seq: Sequence, now: float) -> bool:
        return now - seq.arrival >= self.max_wait_s

    def _reserve(self, running: list[Sequence], waiting: Iterable[Sequence], prefill: int, room: int) -> int:
        """Tokens a running long prefill leaves to the shorter prompts waiting behind it (none when it is due)."""
        now = self.clock()
        longest = 0
        for seq in running:
            if seq.num_unscheduled_tokens > 1:
                if self._is_due(seq, now):
                    return 0
                longest = max(longest, seq.num_unscheduled_tokens)
        reserved = 0
        for seq in self._ordered(waiting, now)[:room]:
            size = seq.num_unscheduled_tokens
            if size >= longest or self._is_due(seq, now) or reserved + size > prefill:
                break
            reserved += size
        return reserved

    def _ordered(self, waiting: Iterable[Sequence], now: float) -> list[Sequence]:
        # due ones first by arrival, then shortest remaining prompt first (ties by arrival)
        return sorted(waiting, key=lambda s: (0, s.arrival, 0) if self._is_due(s, now)
                      else (1, s.num_unscheduled_tokens, s.arrival))

    def admission_order(self, waiting: deque[Sequence], room: int) -> list[Sequence]:
        return self._ordered(waiting, self.clock())[:room]


def build_policy(name: str, tbt_deadline_ms: float) -> SchedulingPolicy:
    """The policy ``EngineConfig.scheduling_policy`` names (``fcfs`` or ``slai``)."""
    if name == "fcfs":
        return SchedulingPolicy()
    if name == "slai":
        return SlaiPolicy(tbt_deadline_ms / 1000)
    raise ValueError(f"unknown scheduling policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")


POLICY_NAMES = ("fcfs", "slai")
