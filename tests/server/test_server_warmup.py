"""The server's start-up warm requests (a chat and a completion, streamed and not, and a Messages stream)
through the app in-process: every reply is whole, nothing stays held or counted (engine accounting, prefix
cache, metrics, access log), the next request runs on another event loop as if none had run; off with the
engine's warm-up switch; ``armillary serve`` runs them before it listens."""
from __future__ import annotations

import asyncio
import json
import logging

import pytest

from armillary.config import EngineConfig
from armillary.engine import LLMEngine
from armillary.server.app import build_app
from armillary.server.async_engine import AsyncEngine
from armillary.server.metrics import ServerMetrics
from armillary.server.parsing import ParserSetup
from armillary.server.state import ServerState
from armillary.server.warm_requests import asgi_request, warm_routes
from plugins.qwen_gdn_moe.tests.harness import qwen_registry
from tests.server.live_server import MODEL_NAME

KEY = "warm-key"
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hello! Warming up."}], "max_tokens": 4}


@pytest.fixture
def serve_in_process(tiny_checkpoint):
    """(state, app, engine requests seen) for an engine built with ``warmup``; shut down after."""
    started = []

    def build(warmup: bool):
        registry = qwen_registry()
        config = EngineConfig(model=str(tiny_checkpoint), dtype="float32", device="cpu", max_model_len=256,
                              max_num_seqs=4, max_num_batched_tokens=64, enable_prefix_caching=True, warmup=warmup)
        engine = AsyncEngine(lambda: LLMEngine(config, registry))
        metrics = ServerMetrics(engine.stats)
        engine.observer = metrics
        engine.start()
        started.append(engine)
        engine.wait_until_loaded(120)
        seen = []
        add = engine.engine.add_request
        engine.engine.add_request = lambda rid, *a, **k: seen.append(rid) or add(rid, *a, **k)
        parsers = ParserSetup.resolve(registry, engine.engine.arch, engine.engine.tokenizer, None, None)
        state = ServerState(engine, [MODEL_NAME], parsers, metrics, api_key=KEY)
        return state, build_app(state), seen

    yield build
    for engine in started:
        engine.shutdown(timeout=10)


def on_engine(state: ServerState, fn):
    return state.engine.call(fn).result(timeout=30)


def test_warm_requests_run_every_route_and_leave_nothing_behind(serve_in_process, caplog):
    state, app, seen = serve_in_process(warmup=True)
    stats_before = on_engine(state, lambda e: e.stats())
    metrics_before = state.metrics.render()
    metrics = state.metrics
    with caplog.at_level(logging.INFO):
        replies = asyncio.run(warm_routes(state, app))
    assert [(r.path, r.streamed) for r in replies] == [
        ("/v1/chat/completions", False), ("/v1/chat/completions", True), ("/v1/messages", True),
        ("/v1/completions", False), ("/v1/completions", True)]
    assert all(r.ok for r in replies), [(r.status, r.body[:200]) for r in replies]
    assert len(seen) == 5 and replies[1].body.rstrip().endswith(b"data: [DONE]")
    assert json.loads(replies[0].body)["usage"]["completion_tokens"] == 8  # ignore_eos: every decode step ran
    assert b"event: message_stop" in replies[2].body
    lines = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("warm-up: server routes (5 requests in-process) ") for m in lines), lines
    assert not [r for r in caplog.records if r.name == "armillary.access"]  # no access line for them
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], lines

    def check(engine):  # on the engine thread: all released, bookkeeping as if nothing ran
        engine.cache.check_accounting()
        return engine.stats(), dict(engine.requests), len(engine.structured)

    stats_after, requests, grammars = on_engine(state, check)
    stats_before.pop("startup_seconds", None), stats_after.pop("startup_seconds", None)
    assert stats_after == stats_before and not requests and not grammars
    assert stats_after["kv_blocks_used"] == 0 and stats_after["kv_blocks_cached"] == 0
    assert stats_after["state_slots_used"] == 0 and stats_after["prefix_cache_prompt_tokens"] == 0
    assert state.metrics is metrics and state.engine.observer is metrics and state.metrics.render() == metrics_before
    assert state.engine.stats()["num_waiting_first_output"] == 0

    # a real request afterwards, on another event loop (uvicorn's): answered, and no prefix-cache hit
    reply = asyncio.run(asgi_request(app, "/v1/chat/completions", CHAT, {"Authorization": f"Bearer {KEY}"}))
    assert reply.status == 200, reply.body
    usage = json.loads(reply.body)["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0 and usage["prompt_tokens"] > 0
    assert len(seen) == 6
    on_engine(state, lambda e: e.cache.check_accounting())


def test_no_warm_requests_with_warm_up_off(serve_in_process):
    state, app, seen = serve_in_process(warmup=False)
    assert asyncio.run(warm_routes(state, app)) is None
    assert seen == []


def test_serve_warms_its_routes_before_listening(server):
    log = server.log()
    warm = log.find("warm-up: server routes (5 requests in-process) ")
    listening = log.find("listening on http://")
    assert 0 <= warm < listening, log
    assert "armillary.access" not in log[:listening] and " answered " not in log[:listening]
