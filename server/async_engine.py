"""The engine behind an event loop: one thread owns the (single-threaded) ``LLMEngine``.

Requests and aborts reach that thread through a thread-safe inbox that it drains between steps;
outputs travel back to per-request asyncio queues through ``loop.call_soon_threadsafe``, so the
event loop never waits on a step.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from armillary.errors import ArmillaryError
from armillary.outputs import RequestOutput
from armillary.sampling_params import SamplingParams

log = logging.getLogger("armillary.server")
HEALTH_POLL_S = 1.0  # how often an idle engine thread asks the worker whether its ranks still run


class EngineUnavailableError(ArmillaryError):
    """The engine cannot take requests now (loading, shutting down, or dead): HTTP 503."""


class EngineOverloadedError(ArmillaryError):
    """Too many requests are waiting for their first token (``max_queue_size``): HTTP 503."""


class EngineDeadError(ArmillaryError):
    """A step raised: the engine is gone and every request in flight fails."""


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    accepted: asyncio.Future


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Call:
    """Run ``fn(engine)`` on the engine thread between steps."""

    fn: Callable[[Any], Any]
    result: concurrent.futures.Future


class _AbortAll:
    """Abort everything in flight and take no more requests (graceful shutdown)."""


class _Stop:
    """Leave the thread."""


class RequestStream:
    """The cumulative outputs of one engine request, in order; async-iterable.

    Outputs are cumulative, so when the consumer falls behind, only the latest one matters: a
    read drains the queue and returns the newest output. Iteration ends after the finished one.
    """

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.arrival = time.monotonic()
        self.first_output_time: float | None = None
        self.last_output_time: float | None = None
        self.num_tokens_seen = 0  # output tokens of every choice so far
        self.num_prompt_tokens = 0  # known from the first output on
        self.done = False  # the finished output or an error was delivered
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._pending_error: BaseException | None = None
        self._ended = False

    def push(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._pending_error is not None:
            err, self._pending_error = self._pending_error, None
            self._ended = True
            raise err
        if self._ended:
            raise StopAsyncIteration
        items = [await self._queue.get()]
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        latest: RequestOutput | None = None
        for item in items:
            if isinstance(item, BaseException):
                self._pending_error = item
                break
            latest = item
        if latest is None:
            return await self.__anext__()
        if latest.finished:
            self._ended = True
        return latest


class AsyncEngine:
    """Runs ``engine_factory()`` and then the step loop in one background thread.

    ``max_queue_size``: how many requests may wait for their first output at once; one more is
    refused with ``EngineOverloadedError`` (None: no bound). ``observer``: receives timing and
    token counts (``ServerMetrics``). ``on_dead``: called on the event loop, after every request in
    flight was failed, when a step raised (the server exits on it: a supervisor restarts it).
    """

    def __init__(self, engine_factory: Callable[[], Any], max_queue_size: int | None = None,
                 observer: Any | None = None, on_dead: Callable[[BaseException], None] | None = None) -> None:
        self._factory = engine_factory
        self.max_queue_size = max_queue_size
        self.observer = observer
        self.on_dead = on_dead
        self.engine: Any | None = None  # read-only use from other threads: tokenizer, arch, limits
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._loaded = threading.Event()
        self._load_error: BaseException | None = None
        self._dead: BaseException | None = None
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}  # event-loop side
        self._num_waiting = 0  # event-loop side: registered streams without an output yet
        self._stats: dict[str, Any] = {}

    # ---- lifecycle

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="armillary-engine", daemon=True)
        self._thread.start()

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event loop that hears the engine (outputs, failures, ``on_dead``) before any request names one: the
        server binds its own at start-up, so an engine that dies while idle still reaches it."""
        if self._streams and self._loop is not loop:
            raise RuntimeError("requests from two event loops at once: the engine answers on one")
        self._loop = loop

    def wait_until_loaded(self, timeout: float | None = None) -> None:
        """Block until the engine is built; re-raises what building it raised."""
        if not self._loaded.wait(timeout):
            raise TimeoutError("the engine did not finish loading in time")
        if self._load_error is not None:
            raise self._load_error

    @property
    def dead(self) -> BaseException | None:
        """What a step raised, once one did; the engine serves nothing afterwards."""
        return self._dead

    @property
    def ready(self) -> bool:
        return (self.engine is not None and self._dead is None and not self._stopping
                and self._thread is not None and self._thread.is_alive())

    def not_ready_reason(self) -> str:
        if self._stopping:
            return "the server is shutting down"
        if self._dead is not None:
            return f"the engine failed: {self._dead}"
        if self.engine is None:
            return "the model is still loading" if self._load_error is None else f"the model failed to load: {self._load_error}"
        return "the engine thread is not running"

    def begin_shutdown(self) -> None:
        """Refuse new requests and abort those in flight. Safe from a signal handler."""
        self._stopping = True
        self._inbox.put(_AbortAll())

    def shutdown(self, timeout: float = 10.0) -> None:
        self.begin_shutdown()
        self._inbox.put(_Stop())
        if self._thread is not None:
            self._thread.join(timeout)

    def stats(self) -> dict[str, Any]:
        """The engine's counters as of its last step, plus the server's own queue of waiting requests."""
        return {**self._stats, "num_waiting_first_output": self._num_waiting}

    # ---- requests (event-loop side)

    async def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> RequestStream:
        """Hand a request to the engine; returns once the engine accepted it.

        Raises ``InvalidRequestError`` (what ``add_request`` refuses), ``EngineOverloadedError``,
        ``EngineUnavailableError`` or ``EngineDeadError``.
        """
        if not self.ready:
            if self._dead is not None:
                raise EngineDeadError(self.not_ready_reason())
            raise EngineUnavailableError(self.not_ready_reason())
        if self.max_queue_size is not None and self._num_waiting >= self.max_queue_size:
            raise EngineOverloadedError(
                f"{self._num_waiting} requests are already waiting (--max-queue-size {self.max_queue_size})")
        loop = asyncio.get_running_loop()
        self.bind_loop(loop)  # the first request, or the first after the warm requests (their own loop)
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in flight")
        stream = RequestStream(request_id)
        self._streams[request_id] = stream
        self._num_waiting += 1
        accepted = loop.create_future()
        self._inbox.put(_Add(request_id, prompt, params, accepted))
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        except BaseException:
            self._forget(request_id)
            raise
        return stream

    async def generate(self, request_id: str, prompt: str | list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """``submit`` and iterate; aborts the request when the consumer stops early."""
        stream = await self.submit(request_id, prompt, params)
        try:
            async for output in stream:
                yield output
        finally:
            if not stream.done:
                self.abort(request_id)

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run ``fn(engine)`` on the engine thread between two steps; its result (or exception) in the future."""
        result: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(_Call(fn, result))
        return result

    def abort(self, request_id: str) -> None:
        """Stop a request and free its memory now; safe for finished or unknown ids."""
        stream = self._forget(request_id)
        if stream is None or stream.done:
            return
        stream.done = True
        self._inbox.put(_Abort(request_id))
        if self.observer is not None:
            self.observer.request_finished("abort")

    def _forget(self, request_id: str) -> RequestStream | None:
        stream = self._streams.pop(request_id, None)
        if stream is not None and stream.first_output_time is None:
            self._num_waiting -= 1
        return stream

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted while the step ran
            self._observe(stream, out, now)
            if out.finished:
                stream.done = True
                self._forget(out.request_id)
            stream.push(out)

    def _observe(self, stream: RequestStream, out: RequestOutput, now: float) -> None:
        num_tokens = sum(len(c.token_ids) for c in out.outputs)
        new_tokens = num_tokens - stream.num_tokens_seen
        stream.num_tokens_seen = num_tokens
        stream.num_prompt_tokens = len(out.prompt_token_ids)
        first = stream.first_output_time is None
        if first:
            stream.first_output_time = now
            self._num_waiting -= 1
        obs = self.observer
        if obs is not None:
            if first:
                obs.first_output(now - stream.arrival, len(out.prompt_token_ids))
            elif new_tokens > 0 and stream.last_output_time is not None:
                # tokens per sequence this step: the step time is each sequence's inter-token gap
                per_seq = max(1, new_tokens // max(1, len(out.outputs)))
                obs.inter_token(now - stream.last_output_time, per_seq)
            obs.tokens_generated(max(0, new_tokens))
            if out.finished:
                for c in out.outputs:
                    obs.request_finished(c.finish_reason or "stop")
        if new_tokens > 0:
            stream.last_output_time = now

    def _fail(self, request_id: str, error: BaseException) -> None:
        stream = self._forget(request_id)
        if stream is not None and not stream.done:
            stream.done = True
            stream.push(error)

    def _fail_all(self, error: BaseException) -> None:
        for request_id in list(self._streams):
            self._fail(request_id, error)

    # ---- the engine thread

    def _post(self, callback: Callable, *args: Any) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop closed between the check and the call
            pass

    @staticmethod
    def _settle(future: asyncio.Future, error: BaseException | None) -> None:
        if future.done():
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    def _run(self) -> None:
        try:
            self.engine = self._factory()
        except BaseException as exc:  # reported by wait_until_loaded
            self._load_error = exc
            self._loaded.set()
            return
        self._stats = self.engine.stats()
        self._loaded.set()
        in_flight: set[str] = set()  # thread side: ids added to the engine and not yet finished
        while True:
            try:
                if self._iterate(in_flight):
                    return
            except Exception as exc:  # a step, or the engine's bookkeeping around it: the engine is gone
                if self._dead is None:
                    self._die(exc, in_flight)
                else:
                    log.warning("the dead engine raised again: %s: %s", type(exc).__name__, exc)

    def _iterate(self, in_flight: set[str]) -> bool:
        """Drain the inbox and run one step; True when told to leave the thread."""
        idle = self._dead is not None or not self.engine.has_unfinished_requests()
        commands = self._drain(block=idle)
        for cmd in commands:
            if isinstance(cmd, _Stop):
                self._abort_everything(in_flight, EngineUnavailableError("the server is shutting down"))
                return True
            self._handle(cmd, in_flight)
        if self._dead is None and self.engine.has_unfinished_requests():
            outputs = self.engine.step()
            for out in outputs:
                if out.finished:
                    in_flight.discard(out.request_id)
            if outputs:
                self._post(self._deliver, outputs)
        if self._dead is None:
            self._stats = self.engine.stats()
        return False

    def _die(self, exc: BaseException, in_flight: set[str]) -> None:
        log.error("engine step failed; the engine stops serving", exc_info=exc)
        self._dead = exc
        in_flight.clear()
        self._post(self._fail_all, EngineDeadError(f"the engine failed: {exc}"))
        if self.on_dead is not None:  # posted after the failures: clients hear first
            self._post(self.on_dead, exc)

    def _drain(self, block: bool) -> list[Any]:
        commands = []
        while block:
            try:
                commands.append(self._inbox.get(timeout=HEALTH_POLL_S))
                break
            except queue.Empty:  # idle: a rank that died now stops the server, not the next request
                if self._dead is None:
                    self.engine.check_health()
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                return commands

    def _handle(self, cmd: Any, in_flight: set[str]) -> None:
        if isinstance(cmd, _Add):
            if self._dead is not None or self._stopping:
                error: BaseException = (EngineDeadError(self.not_ready_reason()) if self._dead is not None
                                        else EngineUnavailableError(self.not_ready_reason()))
                self._post(self._settle, cmd.accepted, error)
                return
            try:
                self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params)
            except Exception as exc:  # InvalidRequestError, or a bug: the request fails, the engine lives
                self._post(self._settle, cmd.accepted, exc)
                return
            in_flight.add(cmd.request_id)
            self._post(self._settle, cmd.accepted, None)
        elif isinstance(cmd, _Abort):
            if cmd.request_id in in_flight:
                in_flight.discard(cmd.request_id)
                self.engine.abort_request(cmd.request_id)
        elif isinstance(cmd, _Call):
            if not cmd.result.set_running_or_notify_cancel():
                return
            try:
                cmd.result.set_result(cmd.fn(self.engine))
            except Exception as exc:  # the caller's to handle; the engine lives
                cmd.result.set_exception(exc)
        elif isinstance(cmd, _AbortAll):
            self._abort_everything(in_flight, EngineUnavailableError("the server is shutting down"))

    def _abort_everything(self, in_flight: set[str], error: BaseException) -> None:
        for request_id in list(in_flight):
            self.engine.abort_request(request_id)
        in_flight.clear()
        self._post(self._fail_all, error)
