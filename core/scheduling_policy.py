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
- ``observe_step(num_tokens, seconds, plan)``: the engine's measured wall time of each completed
  step (with async scheduling, the time between consecutive completed steps) and its plan.

Everything else (running sequences first, chunk stops, preemption, speculation, async
continuation) stays the scheduler's. ``fcfs`` admits in arrival order with the full budget: the
scheduler as it always was. ``slai`` sizes the prefill part of a step so that the predicted step
time, learned online from ``observe_step`` (``StepTimeModel``), stays under ``tbt_deadline_s``
while any stream decodes; when no chunk worth a step can meet it (a prefill step's fixed cost
alone is over the deadline), it stops shrinking and sizes the chunk for throughput, so prompts
never crawl for a deadline that is lost anyway. It admits short prompts before long ones and
makes a running long prefill leave room for them, until a sequence has waited ``max_wait_s``:
then it goes first, in arrival order, at full chunk size (no starvation).
"""
from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from armillary.sequence import Sequence
from armillary.step_plan import StepPlan


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

    def observe_step(self, num_tokens: int, seconds: float, plan: StepPlan | None = None) -> None:
        pass


class StepTimeModel:
    """Step seconds as a function of the step's token count, for one kind of step, learned from measured steps.

    Samples fall into quarter-octave buckets of token count; a bucket's point is the one of its
    latest ``window`` samples at the upper quartile of seconds per token (a compile or a hiccup
    does not move it; later chunks of a long prompt, slower than its first, weigh in); points are
    made non-decreasing. ``line()`` fits ``fixed + per_token * n`` over the points (least squares,
    both terms >= 0): a step's fixed cost (launches, a host-bound eager step) is learned, not
    assumed away. Between points the prediction is linear; outside them it follows the line's
    per-token cost from the nearest point (above the last, the steeper of that and the last
    segment's; below the first, never under the line); with one point only, it is that point's
    time below it and grows in proportion above it. Each choice errs towards a slower step.
    """

    def __init__(self, window: int = 8, points: list[tuple[int, float]] | None = None) -> None:
        self.window = window
        self._samples: dict[int, deque[tuple[int, float]]] = {}
        self._points = points  # (tokens, seconds), ascending, non-decreasing; None: stale
        self._line: tuple[float, float] | None | bool = False  # False: stale

    @classmethod
    def through(cls, points: list[tuple[int, float]]) -> StepTimeModel:
        """A model of exactly ``points`` (ascending tokens, non-decreasing seconds), for predictions only."""
        return cls(points=list(points))

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens < 1 or not seconds > 0 or not math.isfinite(seconds):
            return
        bucket = int(4 * math.log2(num_tokens))
        self._samples.setdefault(bucket, deque(maxlen=self.window)).append((num_tokens, seconds))
        self._points = None
        self._line = False

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

    def line(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token) fitted over the points; None with fewer than two."""
        if self._line is False:
            points = self.points()
            self._line = None
            if len(points) >= 2:
                mx = sum(x for x, _ in points) / len(points)
                my = sum(y for _, y in points) / len(points)
                sxx = sum((x - mx) ** 2 for x, _ in points)
                per_token = max(0.0, sum((x - mx) * (y - my) for x, y in points) / sxx) if sxx else 0.0
                self._line = (max(0.0, my - per_token * mx), per_token)
        return self._line

    def predict(self, num_tokens: int) -> float | None:
        """Seconds a step of ``num_tokens`` tokens is expected to take; None before any measurement."""
        points = self.points()
        if not points:
            return None
        line = self.line()
        x0, y0 = points[0]
        if num_tokens <= x0:
            if line is None:
                return y0
            fixed, per_token = line
            return max(y0 - per_token * (x0 - num_tokens), fixed + per_token * num_tokens)
        for x1, y1 in points[1:]:
            if num_tokens <= x1:
                return y0 + (y1 - y0) * (num_tokens - x0) / (x1 - x0)
            last_slope = (y1 - y0) / (x1 - x0)
            x0, y0 = x1, y1
        if line is None:
            return y0 * num_tokens / x0
        return y0 + max(line[1], last_slope) * (num_tokens - x0)

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


def has_prefill(plan: StepPlan) -> bool:
    """A step with a prompt chunk (eager on a GPU), as opposed to decodes and verifies only (CUDA graphs)."""
    return any(c.num_tokens > 1 and not c.draft_tokens for c in plan.chunks)


class SlaiPolicy(SchedulingPolicy):
    """Deadline-aware (the module docstring): prefill sized to ``tbt_deadline_s``, short prompts first, aging.

    Steps with a prefill chunk and decode-only steps are learned apart (``model``, ``decode_model``):
    on a GPU the latter replay CUDA graphs and cost a fraction of an eager step of the same size,
    so one curve through both would promise small prefill steps that do not exist. While only
    one prefill step size is known, a line to it from the decode-only time (or from zero, before
    any decode-only step) stands in, so the next step measures a second, smaller size.

    ``min_prefill_tokens``: the smallest prefill chunk worth a step; when not even that fits the
    deadline (a step's fixed cost alone exceeds it), every prefill step misses it anyway and the
    chunk is sized for throughput instead (``efficient_chunk``, ``efficient_rate``). ``clock``:
    the clock ``Sequence.arrival`` is on (``time.time`` in the engine).
    """

    name = "slai"

    def __init__(self, tbt_deadline_s: float, model: StepTimeModel | None = None, max_wait_s: float = 2.0,
                 min_prefill_tokens: int = 64, clock: Callable[[], float] = time.time,
                 efficient_rate: float = 0.75) -> None:
        self.tbt_deadline_s = tbt_deadline_s
        self.efficient_rate = efficient_rate
        self.model = model or StepTimeModel()  # steps with a prefill chunk
        self.decode_model = StepTimeModel()  # steps of decodes (and verifies) only
        self.max_wait_s = max_wait_s
        self.min_prefill_tokens = min_prefill_tokens
        self.clock = clock

    def observe_step(self, num_tokens: int, seconds: float, plan: StepPlan | None = None) -> None:
        if plan is not None and not has_prefill(plan):
            self.decode_model.observe(num_tokens, seconds)
        else:
            self.model.observe(num_tokens, seconds)

    def prefill_model(self, num_decodes: int) -> StepTimeModel | None:
        """What predicts a step of ``num_decodes`` decodes plus a chunk; None before any prefill step."""
        points = self.model.points()
        if len(points) != 1:
            return self.model if points else None
        (x, y), = points
        decode = self.decode_model.predict(num_decodes)
        anchor = (0, 0.0) if decode is None else (num_decodes, decode)  # no decode step yet: no fixed cost assumed
        if anchor[0] >= x or anchor[1] > y:
            return self.model
        return StepTimeModel.through([anchor, (x, y)])  # provisional: explores one smaller size

    def prefill_allowance(self, num_decodes: int, limit: int) -> int:
        """Prefill tokens a step with ``num_decodes`` decodes may add: within the deadline when a chunk
        worth a step fits it, else the efficient chunk."""
        spare = max(0, limit - num_decodes)
        if not num_decodes or not spare:
            return spare  # no stream waits on this step: throughput decides
        model = self.prefill_model(num_decodes)
        if model is None:
            return spare  # no prefill step measured yet: the first one teaches the model
        chunk = model.tokens_within(self.tbt_deadline_s, limit) - num_decodes
        if chunk >= min(self.min_prefill_tokens, spare):
            return min(spare, chunk)
        return self.efficient_chunk(model, num_decodes, spare)

    def efficient_chunk(self, model: StepTimeModel, num_decodes: int, spare: int) -> int:
        """A chunk for a step that misses the deadline whatever its size, from the fitted line: the smallest
        whose prefill work is at least the step's fixed part (at most half the step is overhead) and whose
        prefill rate is at least ``efficient_rate`` of the whole budget's (a long prompt's TTFT then stays
        within 1 / ``efficient_rate`` of fcfs's, while each step is smaller); in [min_prefill_tokens, spare]."""
        line = model.line()
        if line is None or line[1] <= 0:
            return spare  # no per-token cost known: the whole budget costs no more than a sliver
        fixed, per_token = line
        overhead = fixed + per_token * num_decodes  # the step's cost without its chunk
        half = math.ceil(overhead / per_token)
        rate = self.efficient_rate * spare / (overhead + per_token * spare)  # tokens / s to keep
        by_rate = math.ceil(rate * overhead / (1 - rate * per_token))  # c / (overhead + per_token c) >= rate
        return min(spare, max(self.min_prefill_tokens, half, by_rate))

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
