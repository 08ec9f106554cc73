"""Prefix caching through a live ``armillary serve --enable-prefix-caching`` (tiny hybrid Qwen3-Next):
a repeated prompt reports its cached tokens (OpenAI ``usage.prompt_tokens_details.cached_tokens``,
streamed and not, chat and completions; Anthropic ``usage.cache_read_input_tokens``), the reply is
the same as the uncached one, and ``/metrics`` carries the hit rate."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.server.live_server import MODEL_NAME, start_server

LONG = " ".join(f"word{i}" for i in range(60))  # a few checkpoints' worth of tokens


@pytest.fixture(scope="module")
def cache_server(tiny_checkpoint, tmp_path_factory):
    live = start_server(tiny_checkpoint, tmp_path_factory.mktemp("prefix") / "serve.log", "--max-model-len", "512",
                        "--enable-prefix-caching", "--ssm-checkpoint-interval", "32", "--generation-config", "vllm")
    yield live
    assert live.stop() == 0, live.log()


def _post(live, path: str, body: dict) -> dict:
    r = httpx.post(f"{live.url}{path}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_and_completions_report_cached_tokens(cache_server):
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "chat " + LONG}], "max_tokens": 4,
            "temperature": 0}
    first = _post(cache_server, "/v1/chat/completions", chat)
    second = _post(cache_server, "/v1/chat/completions", chat)
    prompt = first["usage"]["prompt_tokens"]
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert prompt - 1 >= cached >= 32 and second["usage"]["prompt_tokens"] == prompt
    assert second["choices"][0]["message"] == first["choices"][0]["message"]

    completion = {"model": MODEL_NAME, "prompt": "complete " + LONG, "max_tokens": 3, "temperature": 0}
    _post(cache_server, "/v1/completions", completion)
    again = _post(cache_server, "/v1/completions", completion)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32

    events = []
    with httpx.stream("POST", f"{cache_server.url}/v1/completions", timeout=60,
                      json={**completion, "stream": True, "stream_options": {"include_usage": True}}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32


def test_anthropic_messages_report_cache_reads(cache_server):
    body = {"model": MODEL_NAME, "max_tokens": 3, "temperature": 0,
            "messages": [{"role": "user", "content": "anthropic " + LONG}]}
    first = _post(cache_server, "/v1/messages", body)["usage"]
    second = _post(cache_server, "/v1/messages", body)["usage"]
    assert first["cache_read_input_tokens"] == 0
    assert second["cache_read_input_tokens"] >= 32
    assert second["input_tokens"] + second["cache_read_input_tokens"] == first["input_tokens"]

    deltas = []
    with httpx.stream("POST", f"{cache_server.url}/v1/messages", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"message_delta"' in line:
                deltas.append(json.loads(line[6:]))
    assert deltas[-1]["usage"]["cache_read_input_tokens"] >= 32


def test_metrics_report_the_hit_rate(cache_server):
    body = {"model": MODEL_NAME, "prompt": "metrics " + LONG, "max_tokens": 2, "temperature": 0}
    _post(cache_server, "/v1/completions", body)
    _post(cache_server, "/v1/completions", body)
    m = cache_server.metrics()
    assert 0 < m["armillary_prefix_cache_hit_rate"] < 1
    assert m["armillary_prefix_cache_hit_tokens"] > 0 and m["armillary_state_snapshots_cached"] > 0
