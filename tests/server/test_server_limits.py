"""Request bounds through ``armillary serve``: ``--max-n``, ``--max-stop-strings``, ``--max-tools``, schema depth,
a nested body, and ``--request-timeout`` (408, whole or streamed, nothing held after)."""
from __future__ import annotations

import json
import signal
import time

import httpx
import pytest

from tests.server.live_server import MODEL_NAME, start_server

USER = [{"role": "user", "content": "Tell me a long story."}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def url(tiny_checkpoint, tmp_path_factory):
    live = start_server(tiny_checkpoint, tmp_path_factory.mktemp("limits") / "serve.log", "--max-model-len", "4096",
                        "--request-timeout", "0.5", "--max-n", "2", "--max-stop-strings", "2", "--max-tools", "1",
                        "--max-schema-depth", "6", "--disable-log-stats")
    yield live.url
    assert live.stop(signal.SIGINT) == 0, live.log()


def idle(url: str) -> bool:
    metrics = httpx.get(url + "/metrics").text
    return "armillary_kv_blocks_used 0.0" in metrics and "armillary_num_requests_running 0.0" in metrics


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json={"model": MODEL_NAME, **body}, timeout=60)


@pytest.mark.parametrize("path, body, flag", [
    ("/v1/chat/completions", {"messages": USER, "n": 3, "max_tokens": 2}, "--max-n"),
    ("/v1/completions", {"prompt": "hi", "stop": ["a", "b", "c"], "max_tokens": 2}, "--max-stop-strings"),
    ("/v1/chat/completions", {"messages": USER, "tools": [TOOL, TOOL], "max_tokens": 2}, "--max-tools"),
    ("/v1/messages", {"messages": USER, "max_tokens": 2, "stop_sequences": ["a", "b", "c"]}, "--max-stop-strings"),
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "array", "items": {"type": "array", "items": {
            "type": "array", "items": {"type": "array", "items": {}}}}}}}}}},
     "--max-schema-depth"),
])
def test_bounds_are_400_naming_the_flag(url, path, body, flag):
    r = post(url, path, body)
    assert r.status_code == 400 and flag in r.text, r.text


def test_a_body_nested_past_the_decoder_is_400(url):
    r = httpx.post(url + "/v1/chat/completions", content="[" * 100_000 + "]" * 100_000,
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400 and "nests too deeply" in r.text


def test_request_timeout_ends_whole_and_streamed_requests_with_408(url):
    long = {"max_tokens": 3000, "ignore_eos": True}
    t = time.monotonic()
    whole = post(url, "/v1/chat/completions", {"messages": USER, **long})
    assert whole.status_code == 408 and "--request-timeout" in whole.json()["error"]["message"]
    assert time.monotonic() - t < 10
    with httpx.stream("POST", url + "/v1/completions", timeout=60,
                      json={"model": MODEL_NAME, "prompt": "x", "stream": True, **long}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["error"]["code"] == "request_timeout"
    with httpx.stream("POST", url + "/v1/responses", timeout=60,
                      json={"model": MODEL_NAME, "input": "x", "max_output_tokens": 3000, "ignore_eos": True,
                            "stream": True}) as r:
        last = [line for line in r.iter_lines() if line.startswith("data: ")][-1]
    failed = json.loads(last[6:])
    assert failed["type"] == "response.failed" and failed["response"]["error"]["code"] == "request_timeout"
    stored = httpx.get(f"{url}/v1/responses/{failed['response']['id']}").json()
    assert stored["status"] == "failed" and stored["output"] == failed["response"]["output"]
    whole_response = post(url, "/v1/responses", {"input": "x", "max_output_tokens": 3000, "ignore_eos": True})
    assert whole_response.status_code == 408 and whole_response.json()["error"]["code"] == "request_timeout"
    deadline = time.monotonic() + 5  # aborts reach the engine thread between steps
    while not idle(url) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert idle(url), httpx.get(url + "/metrics").text
    assert post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200
