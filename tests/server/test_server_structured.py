"""Structured output and constrained tool calls through ``armillary serve``, with the official clients.

The tiny model's free output is noise; with a constraint, every one of 50 samples (``n=50`` for
OpenAI, 50 concurrent requests for Anthropic) must parse and validate, streamed or not.
"""
from __future__ import annotations

import asyncio
import json
import re
import signal

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.fixtures.weather_tools import ANTHROPIC_TOOLS, SCHEMAS, TOOLS
from tests.server.live_server import API_KEY, MODEL_NAME, start_server
from tests.server.test_server_live import reassemble_chat_stream

N = 50
USER = [{"role": "user", "content": "What is the weather like in Paris today?"}]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
SAMPLED = {"temperature": 1.0, "seed": 7}
SCHEMA = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Berlin", "Tokyo"]},
    "temp": {"type": "integer", "minimum": -30, "maximum": 45},
    "wind": {"type": "object", "properties": {"dir": {"enum": ["N", "E", "S", "W"]},
                                              "kmh": {"type": "integer", "minimum": 0, "maximum": 150}},
             "required": ["dir"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    "note": {"type": "string", "maxLength": 5}},
    "required": ["city", "temp", "wind"]}


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    """Its own server: a context long enough for 700 prompt tokens (the tools) plus parallel calls."""
    log_path = tmp_path_factory.mktemp("structured_server") / "serve.log"
    live = start_server(tiny_checkpoint, log_path, "--api-key", API_KEY, "--max-model-len", "2048")
    yield live
    assert live.stop(signal.SIGINT) == 0, live.log()


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


def chat(oai: openai.OpenAI, stream: bool, n: int = N, **kw) -> dict[int, dict]:
    """n choices as {index: {content, reasoning, calls, finish}}, from a streamed or a whole reply."""
    args = {"model": MODEL_NAME, "messages": USER, "n": n, **SAMPLED, **kw}
    args["extra_body"] = {**NO_THINK, **args.get("extra_body", {})}
    if stream:
        return reassemble_chat_stream(oai.chat.completions.create(stream=True, **args))["choices"]
    choices = {}
    for c in oai.chat.completions.create(**args).choices:
        calls = {i: {"name": t.function.name, "arguments": t.function.arguments}
                 for i, t in enumerate(c.message.tool_calls or [])}
        choices[c.index] = {"content": c.message.content or "", "calls": calls, "finish": c.finish_reason,
                            "reasoning": getattr(c.message, "reasoning_content", None) or ""}
    return choices


def all_finished(choices: dict[int, dict], reason: str) -> list[dict]:
    assert len(choices) == N
    assert [c["finish"] for c in choices.values()] == [reason] * N
    return list(choices.values())


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_json_schema_response_format(oai, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
    for choice in all_finished(chat(oai, stream, response_format=fmt, max_tokens=120), "stop"):
        jsonschema.validate(json.loads(choice["content"]), SCHEMA)


def test_vllm_extras_regex_choice_json_and_completions(oai):
    pattern = r"[a-f]{2}[0-9]{1,3}"
    for choice in all_finished(chat(oai, False, max_tokens=10, extra_body={"guided_regex": pattern}), "stop"):
        assert re.fullmatch(pattern, choice["content"])
    options = ["sunny", "rainy", "partly cloudy"]
    choices = all_finished(chat(oai, True, max_tokens=20, extra_body={"guided_choice": options}), "stop")
    assert {c["content"] for c in choices} <= set(options)
    small = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    for extra in ({"structured_outputs": {"json": small}}, {"guided_json": json.dumps(small)}):
        for choice in all_finished(chat(oai, False, max_tokens=20, extra_body=extra), "stop"):
            jsonschema.validate(json.loads(choice["content"]), small)
    done = oai.completions.create(model=MODEL_NAME, prompt="The code is", n=N, max_tokens=10, **SAMPLED,
                                  extra_body={"structured_outputs": {"regex": pattern}})
    assert [c.finish_reason for c in done.choices] == ["stop"] * N
    assert all(re.fullmatch(pattern, c.text) for c in done.choices)


FORCED = {
    "required": ({"tool_choice": "required"}, ("get_weather", "convert"), True),
    "single": ({"tool_choice": "required", "parallel_tool_calls": False}, ("get_weather", "convert"), False),
    "named": ({"tool_choice": {"type": "function", "function": {"name": "convert"}}}, ("convert",), False),
}


@pytest.mark.parametrize("case,stream", [("required", True), ("single", False), ("named", True)])
def test_forced_tool_calls_openai(oai, case, stream):
    kw, allowed, parallel = FORCED[case]
    counts = []
    for choice in all_finished(chat(oai, stream, tools=TOOLS, max_tokens=700 if parallel else 200, **kw),
                               "tool_calls"):
        assert choice["content"].strip() == "" and choice["calls"]
        counts.append(len(choice["calls"]))
        for call in choice["calls"].values():
            assert call["name"] in allowed
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    assert max(counts) > 1 if parallel else set(counts) == {1}


def test_auto_with_strict_tools_constrains_the_calls_the_model_opens(oai):
    strict = [{"type": t["type"], "function": {**t["function"], "strict": True}} for t in TOOLS]
    checked = 0
    for choice in chat(oai, False, n=20, tools=strict, tool_choice="auto", max_tokens=150).values():
        calls = list(choice["calls"].values())
        if choice["finish"] == "length":
            calls = calls[:-1]  # the last call may have been cut by max_tokens
        for call in calls:
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
            checked += 1
    assert checked > 0


def test_reasoning_runs_free_before_the_constrained_reply(oai):
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}
    choices = chat(oai, False, n=20, response_format=fmt, max_tokens=150,
                   extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    done = [c for c in choices.values() if c["finish"] == "stop"]
    assert len(done) >= 3
    for c in done:
        assert c["reasoning"] and "</think>" not in c["content"]
        jsonschema.validate(json.loads(c["content"]), SCHEMA)


# ---- Anthropic

async def _anthropic_many(url: str, stream: bool, **kw) -> list[anthropic.types.Message]:
    async with anthropic.AsyncAnthropic(base_url=url, api_key=API_KEY, max_retries=0, timeout=300) as client:
        async def one(i: int) -> anthropic.types.Message:
            args = {"model": MODEL_NAME, "messages": USER, **kw}  # sampled with generation_config's settings
            if not stream:
                return await client.messages.create(**args)
            async with client.messages.stream(**args) as events:
                return await events.get_final_message()
        return await asyncio.gather(*(one(i) for i in range(N)))


@pytest.mark.parametrize("choice,stream", [
    ({"type": "any"}, True), ({"type": "tool", "name": "get_weather"}, False),
    ({"type": "any", "disable_parallel_tool_use": True}, True)], ids=["any-stream", "tool", "one-stream"])
def test_forced_tool_use_anthropic(server, choice, stream):
    """Anthropic requests carry no seed. Parallel calls repeat with probability ~0.45 each, so 1300 tokens
    cover 14 of them; a reply that still runs out says max_tokens, and only its last call may be cut."""
    parallel = choice["type"] == "any" and not choice.get("disable_parallel_tool_use")
    messages = asyncio.run(_anthropic_many(server.url, stream, max_tokens=1300 if parallel else 200,
                                           tools=ANTHROPIC_TOOLS, tool_choice=choice))
    counts = []
    for message in messages:
        assert message.stop_reason == "tool_use" or (parallel and message.stop_reason == "max_tokens")
        assert all(block.type == "tool_use" for block in message.content) and message.content
        counts.append(len(message.content))
        complete = message.content if message.stop_reason == "tool_use" else message.content[:-1]
        for block in complete:
            assert choice["type"] == "any" or block.name == choice["name"]
            jsonschema.validate(block.input, SCHEMAS[block.name])
    assert max(counts) > 1 if parallel else set(counts) == {1}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_anthropic_output_format_json_schema(server, stream):
    messages = asyncio.run(_anthropic_many(server.url, stream, max_tokens=120, extra_body={
        "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}}))
    for message in messages:
        assert message.stop_reason == "end_turn" and [b.type for b in message.content] == ["text"]
        jsonschema.validate(json.loads(message.content[0].text), SCHEMA)


# ---- refusals

ERRORS = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}}},
     'Unsupported type "strnig"', "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema is required",
     "response_format.json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "response_format.type"),
    ({"guided_regex": "(ab"}, "parenthesis is not closed", "guided_regex"),
    ({"guided_grammar": "root ::= missing"}, 'Rule "missing" is not defined', "guided_grammar"),
    ({"guided_choice": []}, "non-empty list", "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "give one", "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "give one", "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "tools": TOOLS, "tool_choice": "required"},
     "cannot be combined", "response_format"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools",
     "tool_choice"),
    ({"tool_choice": "required"}, "needs tools", "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a>b": {"type": "integer"}}}}}], "tool_choice": "required"}, "cannot be written", "tools"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "pattern": "^a$", "maxLength": 2}}}}, "not supported", "response_format.json_schema.schema"),
    ({"min_tokens": 3, "response_format": {"type": "json_object"}}, "min_tokens", None),
]


@pytest.mark.parametrize("extra,message,param", ERRORS, ids=[str(i) for i in range(len(ERRORS))])
def test_invalid_constraints_are_400_naming_the_problem(server, extra, message, param):
    body = {"model": MODEL_NAME, "messages": USER, "max_tokens": 5, **extra}
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60,
                       headers={"Authorization": f"Bearer {API_KEY}"})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert "/project/" not in error["message"] and ".cc:" not in error["message"]


def test_anthropic_refusals_and_nothing_left_running(server):
    claude = anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="not among the tools"):
        claude.messages.create(model=MODEL_NAME, max_tokens=5, messages=USER, tools=ANTHROPIC_TOOLS,
                               tool_choice={"type": "tool", "name": "nope"})
    with pytest.raises(anthropic.BadRequestError, match="enum array must not be empty"):
        claude.messages.create(model=MODEL_NAME, max_tokens=5, messages=USER, extra_body={
            "output_config": {"format": {"type": "json_schema", "schema": {"enum": []}}}})
    metrics = server.metrics()
    assert metrics["armillary_num_requests_running"] == 0 and metrics["armillary_num_requests_waiting"] == 0
    assert metrics["armillary_kv_blocks_used"] == 0
