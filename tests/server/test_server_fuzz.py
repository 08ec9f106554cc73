"""Hypothesis fuzzing of the four generation routes from their request models' JSON schemas: never a 5xx, nothing held after.

Bodies follow each pydantic request model's schema (with wrong types, dropped required fields and
stray values mixed in); output lengths and ``n`` are clamped small so every example finishes in a
fraction of a second on the tiny model. Bounded in count (``max_examples``) and in time (each
route stops drawing after ``BUDGET_S``).
"""
from __future__ import annotations

import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from armillary.server.protocol_anthropic import MessagesRequest
from armillary.server.protocol_openai import ChatCompletionRequest, CompletionRequest
from armillary.server.protocol_responses import ResponsesRequest
from tests.server.live_server import API_KEY, MODEL_NAME

EXAMPLES = 100
BUDGET_S = 10.0  # per route: examples drawn after this are sent as the smallest valid body
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "min_tokens")
ROUTES = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
          "/v1/messages": MessagesRequest, "/v1/responses": ResponsesRequest}
MINIMAL = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
           "/v1/completions": {"prompt": "hi", "max_tokens": 1},
           "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
           "/v1/responses": {"input": "hi", "max_output_tokens": 1}}

JSON_SCALARS = (st.none() | st.booleans() | st.integers(-(2**63), 2**63) | st.floats(allow_nan=False)
                | st.text(max_size=12))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)
TEXTISH = st.text(max_size=24) | st.sampled_from(["", " ", "<think>", "</think>", "<tool_call>", "{\"a\":", "\u0000",
                                                  "<|im_end|>", "<function=get_weather>"])
PART = st.fixed_dictionaries({"type": st.sampled_from(["text", "input_text", "output_text", "image", "tool_result"]),
                              "text": TEXTISH})
INTS = st.integers(0, 40) | st.integers(-3, 3) | st.integers(-(2**70), 2**70)


def from_schema(schema: dict, defs: dict, depth: int = 0) -> st.SearchStrategy:
    """A strategy for values of one JSON-schema node (the subset pydantic emits)."""
    if "$ref" in schema:
        return st.deferred(lambda: from_schema(defs[schema["$ref"].rsplit("/", 1)[-1]], defs, depth + 1))
    if "anyOf" in schema:
        return st.one_of([from_schema(s, defs, depth) for s in schema["anyOf"]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "object" and schema.get("properties"):
        props = {k: from_schema(v, defs, depth + 1) for k, v in schema["properties"].items()}
        required = [k for k in props if k in set(schema.get("required", ()))]
        optional = sorted(k for k in props if k not in required)

        @st.composite
        def objects(draw) -> dict:  # a few optional fields at a time, so one bad value does not hide the rest
            keys = required + draw(st.lists(st.sampled_from(optional), max_size=4, unique=True)) if optional \
                else required
            return {k: draw(props[k]) for k in keys}

        return objects()
    if kind == "object":
        return PART | st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=3)
    if kind == "array":
        item = from_schema(schema.get("items", {}), defs, depth + 1) if depth < 6 else JSON_VALUES
        return st.lists(item, min_size=schema.get("minItems", 0), max_size=3)
    if kind == "string":
        return TEXTISH
    if kind == "integer":
        return INTS
    if kind == "number":
        return st.floats(0, 1.5) | st.floats(-3, 3) | st.floats(allow_nan=False, allow_infinity=False)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return JSON_VALUES


def body_strategy(model: type) -> st.SearchStrategy:
    schema = model.model_json_schema()
    shaped = from_schema(schema, schema.get("$defs", {}))

    @st.composite
    def bodies(draw) -> dict:
        body = dict(draw(shaped))
        mutation = draw(st.sampled_from(["none"] * 5 + ["drop", "retype", "extra"]))
        if mutation == "drop" and body:
            body.pop(draw(st.sampled_from(sorted(body))))
        elif mutation == "retype" and body:
            body[draw(st.sampled_from(sorted(body)))] = draw(JSON_VALUES)
        elif mutation == "extra":
            body[draw(st.text(min_size=1, max_size=10))] = draw(JSON_VALUES)
        body["model"] = draw(st.sampled_from([MODEL_NAME] * 4 + [None] * 3 + ["gpt-4o"]))
        if body["model"] is None:
            del body["model"]
        return clamp(body, keep_bad_lengths=draw(st.integers(0, 4)) == 0)

    return bodies()


def clamp(body: dict, keep_bad_lengths: bool) -> dict:
    """Keep generation short: output lengths and ``n`` that would run long become small; lengths below 1 stay
    (a 400) in a fifth of the bodies and become 1 in the rest, so most bodies get past them."""
    for key in LENGTH_FIELDS:
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            low = 0 if key == "min_tokens" else 1
            body[key] = min(value, 4) if keep_bad_lengths else min(max(value, low), 4)
    if isinstance(body.get("n"), int) and 2 < body["n"] <= 128:  # within --max-n: a short reply, not 128
        body["n"] = 2
    if "max_tokens" not in body and body.get("max_completion_tokens") is None:
        body["max_tokens" if "max_output_tokens" not in body else "max_output_tokens"] = 3
    if "input" in body:  # Responses: its length field is max_output_tokens
        body.setdefault("max_output_tokens", body.pop("max_tokens", 3))
    return body


def send(client: httpx.Client, path: str, body: dict) -> tuple[int, str]:
    raw = json.dumps(body, allow_nan=True)  # NaN / Infinity are not JSON: the server must say 400
    with client.stream("POST", path, content=raw, headers={"content-type": "application/json"}) as r:
        return r.status_code, r.read().decode("utf-8", errors="replace")


def failed_inside(text: str) -> bool:
    """A 200 stream that carries a server-side failure (an error event of a 5xx kind)."""
    return any(marker in text for marker in ('"server_error"', '"engine_failed"', '"api_error"', "response.failed",
                                              "internal error"))


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}", "x-api-key": API_KEY},
                      timeout=60) as c:
        yield c


def held(server) -> dict[str, float]:
    m = server.metrics()
    return {k: m.get(f"armillary_{k}", 0.0) for k in ("kv_blocks_used", "state_slots_used", "state_slots_held",
                                                      "state_snapshots_used", "num_requests_running", "queue_depth")}


@pytest.mark.parametrize("path", list(ROUTES))
def test_fuzzed_bodies_never_get_a_5xx_and_leave_nothing_held(server, client, path):
    started = time.monotonic()
    seen: dict[int, int] = {}

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(body=body_strategy(ROUTES[path]))
    def check(body: dict) -> None:
        if time.monotonic() - started > BUDGET_S:
            body = MINIMAL[path]
        status, text = send(client, path, body)
        seen[status] = seen.get(status, 0) + 1
        assert status < 500, f"{status} for {json.dumps(body)[:2000]}:\n{text[:2000]}"
        if text.startswith(("data:", "event:")):
            assert not failed_inside(text), f"failure inside the stream for {json.dumps(body)[:2000]}:\n{text[:2000]}"

    check()
    assert sum(seen.values()) >= EXAMPLES // 2 and any(s == 200 for s in seen), seen  # both served and refused
    assert any(400 <= s < 500 for s in seen), seen
    status, text = send(client, path, MINIMAL[path])  # still serving
    assert status == 200, text
    deadline = time.monotonic() + 10
    while any(held(server).values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(held(server).values()), held(server)


def test_fuzzed_response_ids_get_4xx_on_every_by_id_route(client):
    from urllib.parse import quote

    @settings(max_examples=30, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(response_id=st.text(min_size=1, max_size=40) | st.just("resp_" + "0" * 24))
    def check(response_id: str) -> None:
        path = "/v1/responses/" + quote(response_id, safe="")
        for method, suffix in (("GET", ""), ("DELETE", ""), ("POST", "/cancel")):
            r = client.request(method, path + suffix)
            assert 400 <= r.status_code < 500, (method, path + suffix, r.status_code, r.text)

    check()
