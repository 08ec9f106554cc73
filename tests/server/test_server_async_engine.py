"""AsyncEngine over a scripted engine: ordering, overload, aborts, engine failure, shutdown."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from armillary.errors import InvalidRequestError
from armillary.outputs import CompletionOutput, RequestOutput
from armillary.sampling_params import SamplingParams
from armillary.server.async_engine import (
    HEALTH_POLL_S,
    AsyncEngine,
    EngineDeadError,
    EngineOverloadedError,
    EngineUnavailableError,
)


class ScriptedEngine:
    """One token (id = step count) per request per step; holds one "block" per unfinished request."""

    def __init__(self) -> None:
        self.requests: dict[str, tuple[list[int], SamplingParams]] = {}
        self.aborted: list[str] = []
        self.paused = threading.Event()  # set: steps make no progress
        self.fail_next_step = False
        self.pause_after: int | None = None  # a request's token count at which steps pause (``paused`` set)
        self.thread_ids: set[int] = set()
        self.health_error: Exception | None = None  # what check_health raises (a rank gone)

    def add_request(self, request_id, prompt, params) -> None:
        self.thread_ids.add(threading.get_ident())
        if not prompt:
            raise InvalidRequestError("the prompt is empty")
        self.requests[request_id] = ([], params)

    def abort_request(self, request_id) -> None:
        self.thread_ids.add(threading.get_ident())
        if self.requests.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def check_health(self) -> None:
        if self.health_error is not None:
            raise self.health_error

    def step(self) -> list[RequestOutput]:
        self.thread_ids.add(threading.get_ident())
        if self.fail_next_step:
            raise RuntimeError("device lost")
        if self.paused.is_set():
            time.sleep(0.001)
            return []
        outputs = []
        for rid, (tokens, params) in list(self.requests.items()):
            tokens.append(len(tokens))
            done = len(tokens) >= params.max_tokens
            text = "".join(chr(97 + t) for t in tokens)
            outputs.append(RequestOutput(rid, None, [1], [CompletionOutput(0, text, list(tokens),
                                                                           "length" if done else None)], done))
            if done:
                del self.requests[rid]
            if self.pause_after is not None and len(tokens) >= self.pause_after:
                self.paused.set()
        return outputs

    def stats(self) -> dict:
        return {"num_waiting": 0, "num_running": len(self.requests), "kv_blocks_total": 8,
                "kv_blocks_used": len(self.requests), "state_slots_total": 4, "state_slots_used": 0,
                "prefix_cache_hit_rate": 0.0}


@pytest.fixture
def engine():
    fake = ScriptedEngine()
    eng = AsyncEngine(lambda: fake, max_queue_size=1)
    eng.start()
    eng.wait_until_loaded(timeout=10)
    yield eng, fake
    eng.shutdown(timeout=5)


async def wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


def test_generate_streams_cumulative_outputs_from_the_engine_thread(engine):
    eng, fake = engine

    async def main():
        outs = [o async for o in eng.generate("r1", [1, 2], SamplingParams(max_tokens=4))]
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].outputs[0].text == "abcd"
    assert all(a.outputs[0].text == b.outputs[0].text[:len(a.outputs[0].text)] for a, b in zip(outs, outs[1:]))
    assert fake.thread_ids == {eng._thread.ident}  # the engine is only ever touched by its own thread
    assert eng.stats()["kv_blocks_used"] == 0 and eng.stats()["num_waiting_first_output"] == 0


def test_refused_request_raises_and_leaves_nothing_behind(engine):
    eng, _ = engine

    async def main():
        with pytest.raises(InvalidRequestError, match="empty"):
            await eng.submit("bad", [], SamplingParams())
        return [o async for o in eng.generate("good", [1], SamplingParams(max_tokens=1))]

    assert asyncio.run(main())[-1].finished
    assert eng.stats()["num_waiting_first_output"] == 0


def test_bounded_queue_refuses_while_a_request_waits_for_its_first_output(engine):
    eng, fake = engine
    fake.paused.set()

    async def main():
        first = await eng.submit("a", [1], SamplingParams(max_tokens=2))
        with pytest.raises(EngineOverloadedError):
            await eng.submit("b", [1], SamplingParams(max_tokens=2))
        fake.paused.clear()
        outs = [o async for o in first]
        second = [o async for o in eng.generate("b", [1], SamplingParams(max_tokens=2))]
        return outs, second

    outs, second = asyncio.run(main())
    assert outs[-1].finished and second[-1].finished


def test_consumer_leaving_early_aborts_and_frees_at_once(engine):
    eng, fake = engine

    async def main():
        fake.pause_after = 1  # unfinished until aborted, however slowly the event loop runs
        gen = eng.generate("long", [1], SamplingParams(max_tokens=10_000))
        await gen.__anext__()
        await gen.aclose()  # what a client disconnect does to the response generator
        await wait_for(lambda: fake.aborted == ["long"] and eng.stats()["kv_blocks_used"] == 0)

    asyncio.run(main())
    assert not fake.requests


def test_failed_step_fails_streams_and_marks_the_engine_dead(engine):
    eng, fake = engine

    async def main():
        fake.paused.set()
        stream = await eng.submit("x", [1], SamplingParams(max_tokens=5))
        fake.fail_next_step = True
        fake.paused.clear()
        with pytest.raises(EngineDeadError, match="device lost"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await eng.submit("y", [1], SamplingParams())

    asyncio.run(main())
    assert not eng.ready and "device lost" in eng.not_ready_reason()


def test_an_idle_engine_that_fails_its_health_check_is_dead_without_a_request(engine):
    """A rank that dies while nothing runs stops the engine within the poll, not at the next request."""
    eng, fake = engine
    assert eng.ready
    fake.health_error = RuntimeError("rank 1 exited with code -9")
    deadline = time.monotonic() + 5 * HEALTH_POLL_S
    while eng.ready and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not eng.ready and "rank 1 exited" in eng.not_ready_reason()


def test_shutdown_aborts_in_flight_and_refuses_new_requests(engine):
    eng, fake = engine

    async def main():
        fake.pause_after = 1  # in flight for good: else a starved event loop may first see all 10,000 tokens
        stream = await eng.submit("x", [1], SamplingParams(max_tokens=10_000))
        await stream.__anext__()
        eng.begin_shutdown()
        with pytest.raises(EngineUnavailableError, match="shutting down"):
            async for _ in stream:
                pass
        with pytest.raises(EngineUnavailableError):
            await eng.submit("y", [1], SamplingParams())

    asyncio.run(main())
    assert fake.aborted == ["x"] and not eng.ready


def test_load_failure_is_reported_by_wait_until_loaded():
    def broken():
        raise FileNotFoundError("no config.json")

    eng = AsyncEngine(broken)
    eng.start()
    with pytest.raises(FileNotFoundError, match="config.json"):
        eng.wait_until_loaded(timeout=5)
    assert not eng.ready and "failed to load" in eng.not_ready_reason()
