"""Bad input in each protocol's error shape and status; disconnects and bad requests leave nothing held."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.server.live_server import API_KEY, MODEL_NAME

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
BEARER = {"Authorization": f"Bearer {API_KEY}"}
X_KEY = {"x-api-key": API_KEY}
USER = [{"role": "user", "content": "hi"}]
OK_CHAT = {"model": MODEL_NAME, "messages": USER, "max_tokens": 2}
OK_MSG = {"model": MODEL_NAME, "messages": USER, "max_tokens": 2}
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 200  # well over the 1024-token context

# (id, method, path, headers, body (dict / raw bytes), status, fragment of the message)
CASES = [
    ("malformed-json-openai", "POST", CHAT, BEARER, b'{"messages": [', 400, "not valid JSON"),
    ("malformed-json-anthropic", "POST", MESSAGES, X_KEY, b"{bad", 400, "not valid JSON"),
    ("not-an-object", "POST", CHAT, BEARER, b"[1, 2]", 400, "JSON object"),
    ("empty-body", "POST", MESSAGES, X_KEY, b"", 400, "empty"),
    ("wrong-type", "POST", CHAT, BEARER, {**OK_CHAT, "temperature": "hot"}, 400, "temperature"),
    ("no-messages", "POST", CHAT, BEARER, {"model": MODEL_NAME, "messages": []}, 400, "messages"),
    ("bad-role", "POST", CHAT, BEARER, {**OK_CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("negative-temperature", "POST", CHAT, BEARER, {**OK_CHAT, "temperature": -1}, 400, "temperature"),
    ("n-zero", "POST", CHAT, BEARER, {**OK_CHAT, "n": 0}, 400, "n must be"),
    ("penalty-range", "POST", CHAT, BEARER, {**OK_CHAT, "presence_penalty": 3}, 400, "presence_penalty"),
    ("logit-bias", "POST", CHAT, BEARER, {**OK_CHAT, "logit_bias": {"5": 10}}, 400, "not supported"),
    ("reserved-template-kwarg", "POST", CHAT, BEARER, {**OK_CHAT, "chat_template_kwargs": {"messages": []}}, 400,
     "may not set"),
    ("top-logprobs-alone", "POST", CHAT, BEARER, {**OK_CHAT, "top_logprobs": 2}, 400, "logprobs"),
    ("too-many-logprobs", "POST", CHAT, BEARER, {**OK_CHAT, "logprobs": True, "top_logprobs": 50}, 400, "logprobs"),
    ("forced-unknown-tool", "POST", CHAT, BEARER, {**OK_CHAT, "tool_choice": {"type": "function", "function": {
        "name": "g"}}, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
     400, "not among the tools"),
    ("bad-json-schema", "POST", CHAT, BEARER, {**OK_CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "strnig"}}}}, 400, "strnig"),
    ("image-part", "POST", CHAT, BEARER, {**OK_CHAT, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "image_url"),
    ("prompt-over-context", "POST", CHAT, BEARER, {**OK_CHAT, "messages": [{"role": "user", "content": LONG_PROMPT}]},
     400, "maximum context length"),
    ("max-tokens-over-context", "POST", CHAT, BEARER, {**OK_CHAT, "max_tokens": 100_000}, 400, "context length"),
    ("token-out-of-vocab", "POST", "/v1/completions", BEARER, {"model": MODEL_NAME, "prompt": [1, 999_999]}, 400,
     "token ids"),
    ("suffix", "POST", "/v1/completions", BEARER, {"model": MODEL_NAME, "prompt": "x", "suffix": "y"}, 400,
     "not supported"),
    ("unknown-model-openai", "POST", CHAT, BEARER, {**OK_CHAT, "model": "gpt-4o"}, 404, "gpt-4o"),
    ("unknown-model-anthropic", "POST", MESSAGES, X_KEY, {**OK_MSG, "model": "claude-x"}, 404, "claude-x"),
    ("unknown-model-get", "GET", "/v1/models/nope", BEARER, None, 404, "nope"),
    ("missing-max-tokens", "POST", MESSAGES, X_KEY, {"model": MODEL_NAME, "messages": USER}, 400, "max_tokens"),
    ("anthropic-forced-unknown-tool", "POST", MESSAGES, X_KEY, {
        **OK_MSG, "tool_choice": {"type": "tool", "name": "g"},
        "tools": [{"name": "f", "input_schema": {"type": "object"}}]}, 400, "not among the tools"),
    ("anthropic-image", "POST", MESSAGES, X_KEY, {**OK_MSG, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]}, 400, "image"),
    ("anthropic-unknown-block", "POST", MESSAGES, X_KEY, {**OK_MSG, "messages": [{"role": "user", "content": [
        {"type": "hologram"}]}]}, 400, "hologram"),
    ("anthropic-over-context", "POST", MESSAGES, X_KEY, {**OK_MSG, "messages": [{"role": "user", "content": LONG_PROMPT}]},
     400, "maximum context length"),
    ("count-tokens-bad", "POST", "/v1/messages/count_tokens", X_KEY, {"model": MODEL_NAME, "messages": "hi"}, 400,
     "messages"),
    ("no-key-openai", "POST", CHAT, {}, OK_CHAT, 401, "API key"),
    ("wrong-key-openai", "POST", CHAT, {"Authorization": "Bearer nope"}, OK_CHAT, 401, "API key"),
    ("x-api-key-not-for-openai", "POST", CHAT, X_KEY, OK_CHAT, 401, "API key"),
    ("no-key-anthropic", "POST", MESSAGES, {}, OK_MSG, 401, "API key"),
    ("wrong-key-anthropic", "POST", MESSAGES, {"x-api-key": "nope"}, OK_MSG, 401, "API key"),
    ("no-key-tokenize", "POST", "/tokenize", {}, {"prompt": "x"}, 401, "API key"),
    ("oversize-openai", "POST", CHAT, BEARER, {**OK_CHAT, "padding": "x" * 70_000}, 413, "limit"),
    ("oversize-anthropic", "POST", MESSAGES, X_KEY, {**OK_MSG, "padding": "x" * 70_000}, 413, "limit"),
    ("unknown-route", "POST", "/v1/embeddings", BEARER, {"input": "x"}, 404, "no route"),
    ("wrong-method", "GET", CHAT, BEARER, None, 405, "Method Not Allowed"),
]


def _send(url: str, method: str, path: str, headers: dict, body) -> httpx.Response:
    kwargs = {"content": body} if isinstance(body, bytes) else ({"json": body} if body is not None else {})
    if isinstance(body, bytes):
        headers = {**headers, "content-type": "application/json"}
    return httpx.request(method, url + path, headers=headers, timeout=60, **kwargs)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_requests_get_the_protocol_error_shape(server, case):
    _, method, path, headers, body, status, fragment = case
    r = _send(server.url, method, path, headers, body)
    assert r.status_code == status, r.text
    data = r.json()
    if path.startswith("/v1/messages"):
        assert data["type"] == "error" and set(data["error"]) == {"type", "message"}
        message = data["error"]["message"]
        expected_type = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                         413: "request_too_large"}[status]
        assert data["error"]["type"] == expected_type
    else:
        assert set(data) == {"error"} and set(data["error"]) == {"message", "type", "param", "code"}
        message = data["error"]["message"]
    assert fragment.lower() in message.lower(), message


def test_good_keys_in_every_accepted_place(server):
    assert _send(server.url, "POST", MESSAGES, BEARER, OK_MSG).status_code == 200  # Bearer works for Anthropic too
    assert _send(server.url, "POST", MESSAGES, X_KEY, OK_MSG).status_code == 200
    assert _send(server.url, "GET", "/health", {}, None).status_code == 200  # health and metrics are open
    assert _send(server.url, "GET", "/metrics", {}, None).status_code == 200


async def _abandon_streams(url: str) -> None:
    """Start streams in both protocols and non-streaming requests, then drop every connection mid-way."""
    long_chat = {"model": MODEL_NAME, "messages": USER, "max_tokens": 200, "ignore_eos": True, "stream": True}
    long_msg = {"model": MODEL_NAME, "messages": USER, "max_tokens": 200, "stream": True, "temperature": 0}
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        for path, body, headers in [(CHAT, long_chat, BEARER), (MESSAGES, long_msg, X_KEY),
                                    ("/v1/completions", {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 200,
                                                         "ignore_eos": True, "stream": True, "n": 2}, BEARER)]:
            async with client.stream("POST", path, json=body, headers=headers) as r:
                assert r.status_code == 200
                lines = 0
                async for line in r.aiter_lines():
                    lines += bool(line)
                    if lines >= 4:
                        break  # leaving the block closes the connection mid-stream
    # a non-streaming request whose client gives up
    async with httpx.AsyncClient(base_url=url, timeout=0.3) as client:
        with pytest.raises(httpx.TimeoutException):
            await client.post(CHAT, json={**long_chat, "stream": False, "max_tokens": 200}, headers=BEARER)


def test_bad_requests_and_disconnects_leave_no_memory_held(server):
    before = server.metrics().get('armillary_requests_finished_total{finish_reason="abort"}', 0.0)
    for case in CASES[:8]:
        _send(server.url, *case[1:5])
    asyncio.run(_abandon_streams(server.url))
    deadline = time.monotonic() + 30
    while True:
        m = server.metrics()
        idle = (m["armillary_kv_blocks_used"] == 0 and m["armillary_state_slots_used"] == 0
                and m["armillary_num_requests_running"] == 0 and m["armillary_num_requests_waiting"] == 0)
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert idle, m
    assert m["armillary_kv_blocks_total"] > 0
    assert m['armillary_requests_finished_total{finish_reason="abort"}'] - before == 4  # three streams, one wait
    assert m['armillary_http_requests_total{route="/v1/chat/completions",status="400"}'] >= 1
    assert m["armillary_time_to_first_token_seconds_count"] >= 4 and m["armillary_inter_token_latency_seconds_count"] > 0
    assert m["armillary_prompt_tokens_total"] > 0 and m["armillary_generation_tokens_total"] > 0
    # still serving
    r = _send(server.url, "POST", CHAT, BEARER, {**OK_CHAT, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
