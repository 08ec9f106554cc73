"""Without a server: the Responses event renderer's order, input items to messages, the store's bounds, request limits, the timeout, and the engine's death reaching ``on_dead``."""
from __future__ import annotations

import asyncio

import pytest

from armillary.parsers.events import ReasoningDelta, TextDelta, ToolCallArgsDelta, ToolCallEnd, ToolCallStart
from armillary.server.errors import APIError
from armillary.server.limits import RequestLimits, nesting_depth
from armillary.server.protocol_responses import ResponsesRequest
from armillary.server.responses_input import input_messages, output_messages
from armillary.server.responses_render import ResponseEventRenderer
from armillary.server.responses_store import ResponseStore


def test_renderer_orders_reasoning_message_and_call_events_and_keeps_items_consistent():
    r = ResponseEventRenderer()
    events = r.render([ReasoningDelta("think"), ReasoningDelta(" more"), TextDelta("  "), TextDelta("Hi"),
                       ToolCallStart(0, "call_1", "f"), ToolCallArgsDelta(0, '{"a"'), ToolCallEnd(0, '{"a": 1}')])
    events += r.finish("completed")
    assert [e["type"] for e in events] == [
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    reasoning, message, call = r.output
    assert reasoning["content"][0]["text"] == "think more" and message["content"][0]["text"] == "  Hi"
    assert call["arguments"] == '{"a": 1}' and call["call_id"] == "call_1" and r.has_tool_calls
    assert all(item["status"] == "completed" for item in r.output)
    added = events[0]["item"]
    assert added["status"] == "in_progress" and added["content"] == []  # a snapshot, not the live item


def test_whitespace_before_a_call_is_dropped_and_a_cut_reply_is_incomplete():
    r = ResponseEventRenderer()
    r.render([TextDelta("\n\n"), ToolCallStart(0, "c", "f"), ToolCallArgsDelta(0, "{}")])
    done = r.finish("incomplete")
    assert [item["type"] for item in r.output] == ["function_call"]
    assert done[-1]["item"]["status"] == "incomplete"
    only_space = ResponseEventRenderer()
    only_space.render([TextDelta(" ")])
    only_space.finish("completed")
    assert only_space.output[0]["content"][0]["text"] == " "


def test_input_items_become_template_messages_and_output_replays():
    body = ResponsesRequest.model_validate({"input": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "call it"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Berlin"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
    ]})
    msgs = input_messages(body.input)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "assistant"]
    assert msgs[2]["reasoning_content"] == "call it" and [c["id"] for c in msgs[2]["tool_calls"]] == ["c1", "c2"]
    assert msgs[3] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    r = ResponseEventRenderer()
    r.render([ReasoningDelta("x"), TextDelta("ok"), ToolCallStart(0, "c9", "f"), ToolCallEnd(0, "{}")])
    r.finish("completed")
    assert output_messages(r.output) == [{"role": "assistant", "content": "ok", "reasoning_content": "x",
                                          "tool_calls": [{"id": "c9", "type": "function",
                                                          "function": {"name": "f", "arguments": "{}"}}]}]


def test_store_bounds_count_and_ttl():
    now = [0.0]
    store = ResponseStore(max_entries=2, ttl_s=10.0, clock=lambda: now[0])
    for k in range(3):
        store.put({"id": f"r{k}", "status": "completed"}, [], [])
    assert store.get("r0") is None and store.get("r1") is not None and len(store) == 2
    now[0] = 10.5
    assert store.get("r2") is None and len(store) == 0
    store.put({"id": "r3"}, [], [])
    assert store.delete("r3") and not store.delete("r3")


def test_limits_refuse_with_400_and_name_the_flag():
    limits = RequestLimits(max_tools=1, max_schema_depth=4, max_schema_bytes=200)
    deep = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}}}}}
    assert nesting_depth(deep) == 5 and nesting_depth(3) == 0 and nesting_depth([[1]]) == 2
    cases = [
        ({"input": "x", "tools": [{"type": "function", "name": "a"}, {"type": "function", "name": "b"}]},
         "--max-tools"),
        ({"input": "x", "tools": [{"type": "function", "name": "a", "parameters": deep}]}, "--max-schema-depth"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {"enum": ["y" * 300]}}}},
         "--max-schema-bytes"),
    ]
    for body, flag in cases:
        with pytest.raises(APIError) as info:
            limits.check_responses(ResponsesRequest.model_validate(body))
        assert info.value.status == 400 and flag in info.value.message
    limits.check_responses(ResponsesRequest.model_validate({"input": "x", "tools": [{"type": "function",
                                                                                       "name": "a"}]}))


def test_on_dead_runs_after_the_streams_failed_and_the_timeout_aborts_a_stream():
    from armillary.sampling_params import SamplingParams
    from armillary.server.async_engine import AsyncEngine, EngineDeadError
    from tests.server.test_server_async_engine import ScriptedEngine

    fake = ScriptedEngine()
    seen: list[str] = []
    eng = AsyncEngine(lambda: fake)
    eng.start()
    eng.wait_until_loaded(timeout=10)
    limits = RequestLimits(request_timeout_s=0.05)

    async def main():
        fake.paused.set()
        slow = await eng.submit("slow", [1], SamplingParams(max_tokens=5))
        limits.arm_timeout(slow, eng.abort)
        with pytest.raises(APIError) as info:
            async for _ in slow:
                pass
        assert info.value.status == 408 and "--request-timeout" in info.value.message
        stream = await eng.submit("x", [1], SamplingParams(max_tokens=5))
        eng.on_dead = lambda exc: seen.append(f"dead {exc} after {stream.done}")
        fake.fail_next_step = True
        fake.paused.clear()
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        for _ in range(100):
            if seen:
                break
            await asyncio.sleep(0.01)

    try:
        asyncio.run(main())
    finally:
        eng.shutdown(timeout=5)
    assert "slow" in fake.aborted
    assert seen == ["dead device lost after True"] and eng.dead is not None and not eng.ready


def test_an_exception_beside_the_step_kills_the_engine_too():
    from armillary.sampling_params import SamplingParams
    from armillary.server.async_engine import AsyncEngine, EngineDeadError
    from tests.server.test_server_async_engine import ScriptedEngine

    fake = ScriptedEngine()
    eng = AsyncEngine(lambda: fake)
    eng.start()
    eng.wait_until_loaded(timeout=10)
    dead: list[BaseException] = []
    eng.on_dead = dead.append

    def broken_stats() -> dict:
        raise RuntimeError("bookkeeping failed")

    async def main():
        fake.paused.set()
        stream = await eng.submit("x", [1], SamplingParams(max_tokens=50))
        fake.stats = broken_stats  # the thread's next iteration raises outside step()
        fake.paused.clear()
        with pytest.raises(EngineDeadError, match="bookkeeping failed"):
            async for _ in stream:
                pass
        for _ in range(100):
            if dead:
                break
            await asyncio.sleep(0.01)

    try:
        asyncio.run(main())
    finally:
        eng.shutdown(timeout=5)
    assert [str(e) for e in dead] == ["bookkeeping failed"] and not eng.ready
