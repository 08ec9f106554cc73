"""Start-up logs, 503 while loading or overloaded, and a graceful SIGTERM with requests in flight."""
from __future__ import annotations

import asyncio
import signal
import threading

import httpx
import pytest

from armillary.server.app import build_app
from armillary.server.async_engine import AsyncEngine
from armillary.server.metrics import ServerMetrics
from armillary.server.parsing import ParserSetup
from armillary.server.state import ServerState
from tests.server.live_server import MODEL_NAME, start_server

LONG_CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1500,
             "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def single_seat_server(tiny_checkpoint, tmp_path_factory):
    """No API key; one running sequence and one waiting request at most."""
    log_path = tmp_path_factory.mktemp("lifecycle_logs") / "serve.log"
    live = start_server(tiny_checkpoint, log_path, "--max-model-len", "2048", "--max-num-seqs", "1",
                        "--max-queue-size", "1")
    yield live
    live.stop()


def test_startup_logs_one_line_per_stage_and_warns_without_a_key(single_seat_server):
    log = single_seat_server.log()
    stages = ["plugins found: ", "weights loaded: ", "memory plan: ", "parsers: reasoning parser qwen3, "
              "tool-call parser qwen3_coder", "listening on http://127.0.0.1:"]
    positions = [log.find(s) for s in stages]
    assert all(p >= 0 for p in positions) and positions == sorted(positions), log
    assert "qwen_gdn_moe" in log and "no API key set" in log
    assert httpx.get(f"{single_seat_server.url}/v1/models").status_code == 200  # open without a key


async def _overload_then_terminate(live) -> tuple[list[str], list[str], list[httpx.Response]]:
    async with httpx.AsyncClient(base_url=live.url, timeout=60) as client:
        async with client.stream("POST", "/v1/chat/completions", json=LONG_CHAT) as running:
            running_lines = running.aiter_lines()
            seen_a: list[str] = []
            while sum(1 for x in seen_a if x.startswith("data: ")) < 2:  # role chunk, then generated text
                seen_a.append(await running_lines.__anext__())
            async with client.stream("POST", "/v1/chat/completions", json=LONG_CHAT) as waiting:
                assert waiting.status_code == 200  # accepted; waits for the only seat
                refused = [
                    await client.post("/v1/chat/completions", json={**LONG_CHAT, "stream": False}),
                    await client.post("/v1/messages", json={"model": MODEL_NAME, "max_tokens": 5,
                                                            "messages": [{"role": "user", "content": "hi"}]}),
                ]
                live.proc.send_signal(signal.SIGTERM)
                rest_b = [line async for line in waiting.aiter_lines()]
            rest_a = seen_a + [line async for line in running_lines]
    return rest_a, rest_b, refused


def test_overload_is_503_and_sigterm_aborts_in_flight_and_exits_zero(single_seat_server):
    live = single_seat_server
    running, waiting, refused = asyncio.run(_overload_then_terminate(live))
    openai_503, anthropic_503 = refused
    assert openai_503.status_code == 503 and openai_503.headers["retry-after"] == "1"
    assert "overloaded" in openai_503.json()["error"]["message"]
    assert anthropic_503.status_code == 503
    assert anthropic_503.json()["error"]["type"] == "overloaded_error"
    for lines in (running, waiting):
        data = [line for line in lines if line.startswith("data: ")]
        assert data[-1] == "data: [DONE]"
        assert "shutting down" in data[-2], data[-3:]
    assert live.proc.wait(timeout=30) == 0, live.log()
    assert "SIGTERM: no new requests, aborting the ones in flight" in live.log()


class _BlockedLoad:
    """An engine factory that does not return until released: the server is up but not ready."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def __call__(self):
        self.release.wait(30)
        raise RuntimeError("never loads")


def test_not_ready_answers_503_in_both_shapes():
    loader = _BlockedLoad()
    engine = AsyncEngine(loader)
    engine.start()
    state = ServerState(engine, [MODEL_NAME], ParserSetup(), ServerMetrics(engine.stats))
    app = build_app(state)

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            health = await client.get("/health")
            chat = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
            msg = await client.post("/v1/messages", json={"model": MODEL_NAME, "max_tokens": 2,
                                                          "messages": [{"role": "user", "content": "x"}]})
            return health, chat, msg

    try:
        health, chat, msg = asyncio.run(main())
    finally:
        loader.release.set()
    assert health.status_code == 503 and "still loading" in health.json()["error"]["message"]
    assert chat.status_code == 503 and chat.json()["error"]["type"] == "service_unavailable_error"
    assert msg.status_code == 503 and msg.json()["error"]["type"] == "overloaded_error"
    assert "retry-after" in chat.headers
