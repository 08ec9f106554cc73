"""The Responses API through ``armillary serve`` and the official openai client: text, the streamed event order,
a forced function call, ``previous_response_id`` follow-ups, a ``function_call_output`` round trip, the store."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.fixtures.weather_tools import SCHEMAS, TOOLS
from tests.server.live_server import API_KEY, MODEL_NAME

FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]  # the Responses API's flat tool shape
NO_THINK = {"reasoning": {"effort": "none"}}
GREEDY = {"temperature": 0.0}
QUESTION = "What is the weather like in Paris today?"


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def auth() -> dict:
    return {"Authorization": f"Bearer {API_KEY}"}


def item_order_ok(types: list[str]) -> None:
    """The documented nesting: each output item opens, its parts and deltas follow, it closes before the next."""
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete")
    body = types[2:-1]
    i = 0
    while i < len(body):
        assert body[i] == "response.output_item.added", body[i:]
        end = body.index("response.output_item.done", i)
        inner = body[i + 1:end]
        if inner and inner[0] == "response.content_part.added":
            kind = {"response.output_text.delta": "output_text", "response.reasoning_text.delta": "reasoning_text"}
            deltas = set(inner[1:-2])
            assert len(deltas) == 1 and deltas.pop() in kind, inner
            text_kind = kind[inner[1]]
            assert inner[-2:] == [f"response.{text_kind}.done", "response.content_part.done"]
        else:
            assert inner[-1] == "response.function_call_arguments.done"
            assert set(inner[:-1]) <= {"response.function_call_arguments.delta"}
        i = end + 1


def test_text_response_is_stored_and_matches_its_stream(server, oai):
    kw = dict(model=MODEL_NAME, input=QUESTION, instructions="Be terse.", max_output_tokens=8,
              extra_body={"ignore_eos": True}, **NO_THINK, **GREEDY)
    r = oai.responses.create(**kw)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL_NAME
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text and [item.type for item in r.output] == ["message"]
    assert r.usage.output_tokens == 8 and r.usage.total_tokens == r.usage.input_tokens + 8
    assert r.usage.input_tokens_details.cached_tokens >= 0 and r.instructions == "Be terse."
    assert oai.responses.retrieve(r.id).output_text == r.output_text
    events = list(oai.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    item_order_ok(types)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert types[-1] == "response.incomplete" and final.status == "incomplete"
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.output_text == r.output_text == streamed
    assert final.usage.output_tokens == 8
    assert oai.responses.retrieve(final.id).status == "incomplete"  # stored once the stream ended


def test_streamed_reasoning_comes_first_as_its_own_item(oai):
    events = list(oai.responses.create(model=MODEL_NAME, input=QUESTION, max_output_tokens=6, stream=True,
                                       reasoning={"effort": "high"}, extra_body={"ignore_eos": True}, **GREEDY))
    item_order_ok([e.type for e in events])
    first = next(e for e in events if e.type == "response.output_item.added")
    assert first.item.type == "reasoning"  # the template opened <think>: a random model's text stays reasoning
    final = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert final.output[0].content[0].text == text and final.usage.output_tokens_details.reasoning_tokens > 0


def forced_call(oai, stream: bool):
    kw = dict(model=MODEL_NAME, input=QUESTION, tools=FLAT_TOOLS, max_output_tokens=200,
              tool_choice={"type": "function", "name": "get_weather"}, **NO_THINK, **GREEDY)
    if not stream:
        return oai.responses.create(**kw), None
    events = list(oai.responses.create(stream=True, **kw))
    return events[-1].response, events


def test_forced_function_call_streamed_and_not(oai):
    whole, _ = forced_call(oai, False)
    calls = [item for item in whole.output if item.type == "function_call"]
    assert whole.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS["get_weather"])
    assert calls[0].call_id and calls[0].id.startswith("fc_")
    final, events = forced_call(oai, True)
    item_order_ok([e.type for e in events])
    streamed = [item for item in final.output if item.type == "function_call"]
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert deltas == done.arguments == calls[0].arguments


def tokens_of(server, messages: list[dict], **extra) -> int:
    body = {"messages": messages, "chat_template_kwargs": {"enable_thinking": False}, **extra}
    return httpx.post(f"{server.url}/tokenize", headers=auth(), json=body).json()["count"]


def test_previous_response_id_continues_the_conversation(server, oai):
    first = oai.responses.create(model=MODEL_NAME, input=QUESTION, instructions="Be terse.", max_output_tokens=5,
                                 extra_body={"ignore_eos": True}, **NO_THINK, **GREEDY)
    follow = oai.responses.create(model=MODEL_NAME, input="And tomorrow?", previous_response_id=first.id,
                                  max_output_tokens=3, **NO_THINK, **GREEDY)
    assert follow.previous_response_id == first.id
    # the first turn's instructions are not carried over (as OpenAI); its input and output are
    expected = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "And tomorrow?"}]
    assert follow.usage.input_tokens == tokens_of(server, expected)
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model=MODEL_NAME, input="x", previous_response_id="resp_nope", max_output_tokens=2)


def test_function_call_output_round_trip(server, oai):
    call_turn, _ = forced_call(oai, False)
    call = next(item for item in call_turn.output if item.type == "function_call")
    reply = oai.responses.create(model=MODEL_NAME, previous_response_id=call_turn.id, tools=FLAT_TOOLS,
                                 input=[{"type": "function_call_output", "call_id": call.call_id,
                                         "output": "sunny, 24 C"}],
                                 max_output_tokens=4, tool_choice="none", **NO_THINK, **GREEDY)
    assert reply.status in ("completed", "incomplete") and reply.usage.output_tokens <= 4
    expected = [{"role": "user", "content": QUESTION},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": call.call_id, "type": "function",
                     "function": {"name": call.name, "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 24 C"}]
    assert reply.usage.input_tokens == tokens_of(server, expected)  # tool_choice none: tools left out
    # the same turn sent by hand, items instead of previous_response_id, renders the same prompt
    by_hand = oai.responses.create(model=MODEL_NAME, input=[
        {"role": "user", "content": QUESTION},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 24 C"}],
        max_output_tokens=4, store=False, **NO_THINK, **GREEDY)
    assert by_hand.usage.input_tokens == reply.usage.input_tokens and by_hand.output_text == reply.output_text


def test_store_false_delete_and_errors(server, oai):
    unstored = oai.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=2, store=False, **NO_THINK)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(unstored.id)
    kept = oai.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=2, **NO_THINK)
    oai.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(kept.id)
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        oai.responses.create(model=MODEL_NAME, input="hi", tools=FLAT_TOOLS, max_output_tokens=2,
                             tool_choice={"type": "function", "name": "nope"})
    with pytest.raises(openai.BadRequestError, match="only a response still generating"):
        oai.responses.cancel(oai.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=2).id)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    structured = oai.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=40, **NO_THINK,
                                      text={"format": {"type": "json_schema", "name": "r", "schema": schema}})
    assert structured.status == "completed"
    jsonschema.validate(json.loads(structured.output_text), schema)


def test_cancel_stops_a_streaming_response(server, oai):
    stream = oai.responses.create(model=MODEL_NAME, input=QUESTION, max_output_tokens=400, stream=True,
                                  extra_body={"ignore_eos": True}, **NO_THINK)
    created = None
    for event in stream:
        if event.type == "response.created":
            created = event.response.id
        if event.type == "response.output_text.delta":
            cancelled = oai.responses.cancel(created)
            assert cancelled.status == "cancelled"
            break
    last = list(stream)[-1]
    assert last.type == "response.incomplete" and last.response.status == "cancelled"
    assert last.response.usage is None or last.response.usage.output_tokens < 400
    assert oai.responses.retrieve(created).status == "cancelled"
