"""A real ``armillary serve`` subprocess driven with the official openai and anthropic clients."""
from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import openai
import pytest

from tests.server.live_server import API_KEY, MODEL_NAME

GREEDY = {"temperature": 0.0}
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Current weather of a city",
                    "input_schema": TOOLS[0]["function"]["parameters"]}]
USER = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)


def auth() -> dict:
    return {"Authorization": f"Bearer {API_KEY}"}


def reassemble_chat_stream(chunks) -> dict:
    """Fold openai SDK stream chunks into one message per choice, plus usage."""
    choices: dict[int, dict] = {}
    usage = None
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            msg = choices.setdefault(c.index, {"content": "", "reasoning": "", "calls": {}, "finish": None})
            delta = c.delta.model_dump()
            msg["content"] += delta.get("content") or ""
            msg["reasoning"] += delta.get("reasoning_content") or ""
            for call in delta.get("tool_calls") or []:
                slot = msg["calls"].setdefault(call["index"], {"id": None, "name": None, "arguments": ""})
                if call.get("id"):
                    slot["id"], slot["name"] = call["id"], call["function"]["name"]
                slot["arguments"] += (call.get("function") or {}).get("arguments") or ""
            if c.finish_reason is not None:
                assert msg["finish"] is None, "finish_reason sent twice"
                msg["finish"] = c.finish_reason
    return {"choices": choices, "usage": usage}


def blocks_of(content) -> list[dict]:
    """Anthropic content blocks as plain dicts (the SDK's streamed and whole block classes differ)."""
    keys = ("type", "text", "thinking", "id", "name", "input")
    return [{k: getattr(b, k) for k in keys if hasattr(b, k)} for b in content]


def message_of(choice) -> dict:
    m = choice.message.model_dump()
    calls = {i: {"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
             for i, c in enumerate(m.get("tool_calls") or [])}
    return {"content": m.get("content") or "", "reasoning": m.get("reasoning_content") or "", "calls": calls,
            "finish": choice.finish_reason}


# ---- OpenAI


def test_models_health_and_open_endpoints(server, oai):
    assert [m.id for m in oai.models.list().data] == [MODEL_NAME]
    assert oai.models.retrieve(MODEL_NAME).id == MODEL_NAME
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert "armillary_kv_blocks_total" in httpx.get(f"{server.url}/metrics").text


def test_chat_non_streaming_usage_and_length_finish(server, oai):
    r = oai.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=6, extra_body={"ignore_eos": True},
                                    **GREEDY)
    tok = httpx.post(f"{server.url}/tokenize", headers=auth(), json={"messages": USER}).json()
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 6 and r.usage.prompt_tokens == tok["count"]
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6


@pytest.mark.parametrize("thinking", [True, False])
def test_chat_streaming_equals_non_streaming(oai, thinking):
    extra = {"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": thinking}}
    whole = oai.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=8, extra_body=extra, **GREEDY)
    stream = oai.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=8, extra_body=extra, stream=True,
                                         stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    got = reassemble_chat_stream(chunks)
    assert got["choices"][0] == message_of(whole.choices[0])
    if thinking:  # the template opened <think>: a random model's text stays reasoning
        assert whole.choices[0].message.model_dump()["reasoning_content"]
    else:
        assert "reasoning_content" not in whole.choices[0].message.model_dump(exclude_unset=True)


def test_sampling_fields_are_accepted_and_max_completion_tokens_wins(oai):
    r = oai.chat.completions.create(
        model=MODEL_NAME, messages=USER, max_tokens=9, max_completion_tokens=3, presence_penalty=0.5,
        frequency_penalty=0.5, top_p=0.9, temperature=0.7, reasoning_effort="low",
        extra_body={"repetition_penalty": 1.2, "min_p": 0.05, "top_k": 5, "ignore_eos": True})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_seed_reproducible_and_n_choices(oai):
    kw = dict(model=MODEL_NAME, messages=USER, max_tokens=8, temperature=1.0, top_p=1.0,
              extra_body={"top_k": 0, "ignore_eos": True, **NO_THINK})
    a = oai.chat.completions.create(seed=1234, **kw)
    b = oai.chat.completions.create(seed=1234, **kw)
    assert a.choices[0].message.content == b.choices[0].message.content
    many = oai.chat.completions.create(seed=5, n=3, **kw)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert many.usage.completion_tokens == 24
    streamed = reassemble_chat_stream(oai.chat.completions.create(seed=5, n=3, stream=True, **kw))
    assert [streamed["choices"][i]["content"] for i in range(3)] == [c.message.content for c in many.choices]


def test_stop_strings_cut_the_text(oai, claude):
    base = dict(model=MODEL_NAME, messages=USER, extra_body={"ignore_eos": True, **NO_THINK}, **GREEDY)
    text = oai.chat.completions.create(max_tokens=12, **base).choices[0].message.content
    stop = text[4:6]
    assert len(stop) == 2
    cut = oai.chat.completions.create(max_tokens=12, stop=[stop], **base).choices[0]
    assert cut.finish_reason == "stop" and cut.message.content == text[:text.find(stop)]
    # Anthropic: thinking off by default, so the same greedy text; stop_sequence reported back
    whole = claude.messages.create(model=MODEL_NAME, max_tokens=12, messages=USER, extra_body={"temperature": 0.0})
    full = "".join(b.text for b in whole.content if b.type == "text")
    assert whole.stop_reason == "max_tokens" and len(full) >= 6  # the fixed random model does not stop early
    seq = full[4:6]
    msg = claude.messages.create(model=MODEL_NAME, max_tokens=12, messages=USER, stop_sequences=[seq],
                                 extra_body={"temperature": 0.0})
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == seq
    assert "".join(b.text for b in msg.content if b.type == "text") == full[:full.find(seq)]


def test_logprobs_chat_and_completions(oai):
    r = oai.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=5, logprobs=True, top_logprobs=3,
                                    extra_body={"ignore_eos": True}, **GREEDY)
    entries = r.choices[0].logprobs.content
    assert len(entries) == 5
    for e in entries:
        assert len(e.top_logprobs) == 3
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob, abs=1e-5)  # greedy took the best token
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob
    stream = oai.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=5, logprobs=True, top_logprobs=2,
                                         extra_body={"ignore_eos": True}, stream=True, **GREEDY)
    streamed = [e for c in stream for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in entries]
    c = oai.completions.create(model=MODEL_NAME, prompt="The quick brown fox", max_tokens=4, logprobs=2,
                               extra_body={"ignore_eos": True}, **GREEDY)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert lp.text_offset[0] == 0 and all(len(t) == 2 for t in lp.top_logprobs)


def test_completions_batch_echo_and_stream(oai):
    r = oai.completions.create(model=MODEL_NAME, prompt=["Hello there", "The quick brown fox"], n=2, max_tokens=3,
                               extra_body={"ignore_eos": True}, **GREEDY)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 12
    by_index = {c.index: c.text for c in r.choices}
    assert by_index[0] == by_index[1] and by_index[2] == by_index[3]  # greedy: both samples of a prompt agree
    ids = oai.completions.create(model=MODEL_NAME, prompt=[[11, 12, 13], [14, 15]], max_tokens=2, **GREEDY)
    assert ids.usage.prompt_tokens == 5 and len(ids.choices) == 2
    echo = oai.completions.create(model=MODEL_NAME, prompt="Hello there", max_tokens=3, echo=True, **GREEDY)
    assert echo.choices[0].text.startswith("Hello there")
    chunks = list(oai.completions.create(model=MODEL_NAME, prompt="Hello there", max_tokens=3, stream=True,
                                         stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
                                         **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == by_index[0]
    assert chunks[-1].usage.completion_tokens == 3


def test_multi_turn_tool_round_trip_reaches_the_template(server, oai):
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"},
    ]
    r = oai.chat.completions.create(model=MODEL_NAME, messages=history, tools=TOOLS, max_tokens=4, **GREEDY)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    ids = httpx.post(f"{server.url}/tokenize", headers=auth(), json={"messages": history, "tools": TOOLS}).json()
    assert ids["count"] == r.usage.prompt_tokens
    text = httpx.post(f"{server.url}/detokenize", headers=auth(), json={"tokens": ids["tokens"]}).json()["prompt"]
    assert "<function=get_weather>\n<parameter=city>\nParis" in text and "<tool_response>\nsunny, 24 C" in text
    assert '"name": "get_weather"' in text  # the tool definitions


@pytest.mark.parametrize("thinking", [True, False])
def test_tools_present_streaming_equals_non_streaming(oai, thinking):
    kw = dict(model=MODEL_NAME, messages=USER, tools=TOOLS, max_tokens=10,
              extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": thinking}}, **GREEDY)
    whole = oai.chat.completions.create(**kw)
    got = reassemble_chat_stream(oai.chat.completions.create(stream=True, **kw))
    assert got["choices"][0] == message_of(whole.choices[0])
    none = oai.chat.completions.create(**{**kw, "tool_choice": "none"})
    assert none.usage.prompt_tokens < whole.usage.prompt_tokens  # tool_choice none: tools left out of the prompt


def test_tokenize_detokenize(server):
    r = httpx.post(f"{server.url}/tokenize", headers=auth(),
                   json={"model": MODEL_NAME, "prompt": "hello world", "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) == len(r["token_strs"]) and r["max_model_len"] == 1024
    assert "".join(r["token_strs"]) == "hello world"
    back = httpx.post(f"{server.url}/detokenize", headers=auth(), json={"tokens": r["tokens"]}).json()
    assert back == {"prompt": "hello world"}


# ---- Anthropic


def test_anthropic_message_streaming_equals_non_streaming(claude):
    kw = dict(model=MODEL_NAME, max_tokens=8, system="You are terse.", messages=USER, extra_body={"temperature": 0.0})
    whole = claude.messages.create(**kw)
    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_")
    assert whole.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in whole.content] == ["text"]  # thinking is opt-in on this protocol
    with claude.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert blocks_of(final.content) == blocks_of(whole.content) and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens
    counted = claude.messages.count_tokens(model=MODEL_NAME, system="You are terse.", messages=USER)
    assert counted.input_tokens == whole.usage.input_tokens


def test_anthropic_raw_event_sequence_with_thinking(server):
    body = {"model": MODEL_NAME, "max_tokens": 6, "messages": USER, "stream": True, "temperature": 0.0,
            "thinking": {"type": "enabled", "budget_tokens": 1024}}
    with httpx.stream("POST", f"{server.url}/v1/messages", json=body, headers={"x-api-key": API_KEY},
                      timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = []
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                payload = json.loads(line[6:])
                assert payload["type"] == name
                events.append(payload)
    names = [e["type"] for e in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    assert names[2] == "content_block_start" and events[2]["content_block"]["type"] == "thinking"
    middle = names[2:-2]
    assert middle.count("content_block_start") == middle.count("content_block_stop") >= 1
    assert events[-2]["usage"]["output_tokens"] <= 6
    assert events[-2]["delta"]["stop_reason"] in ("end_turn", "max_tokens")


def test_anthropic_tool_use_round_trip(claude):
    messages = USER + [
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I need the tool.", "signature": ""},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 24 C"}]},
    ]
    msg = claude.messages.create(model=MODEL_NAME, max_tokens=6, messages=messages, tools=ANTHROPIC_TOOLS,
                                 extra_body={"temperature": 0.0})
    assert msg.stop_reason in ("end_turn", "max_tokens", "tool_use")
    with claude.messages.stream(model=MODEL_NAME, max_tokens=6, messages=messages, tools=ANTHROPIC_TOOLS,
                                extra_body={"temperature": 0.0}) as stream:
        assert blocks_of(stream.get_final_message().content) == blocks_of(msg.content)
    bare = claude.messages.count_tokens(model=MODEL_NAME, messages=USER, tools=ANTHROPIC_TOOLS)
    assert claude.messages.count_tokens(model=MODEL_NAME, messages=messages, tools=ANTHROPIC_TOOLS).input_tokens > \
        bare.input_tokens


def test_sdk_errors_carry_the_server_message(oai, claude):
    with pytest.raises(openai.NotFoundError) as info:
        oai.chat.completions.create(model="gpt-4o", messages=USER, max_tokens=2)
    assert "gpt-4o" in info.value.message
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(model=MODEL_NAME, max_tokens=2, messages=USER,
                               tool_choice={"type": "tool", "name": "nope"}, tools=ANTHROPIC_TOOLS)
    assert "not among the tools" in str(info.value)
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=claude.base_url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL_NAME, max_tokens=2, messages=USER)


def test_concurrent_streams_in_both_protocols_match_their_sequential_replies(server, oai, claude):
    prompts = [f"Question {i}: what is {i} plus {i}?" for i in range(6)]
    chat_kw = dict(model=MODEL_NAME, max_tokens=6, extra_body={"ignore_eos": True}, **GREEDY)
    msg_kw = dict(model=MODEL_NAME, max_tokens=6, extra_body={"temperature": 0.0})
    expected_chat = [message_of(oai.chat.completions.create(messages=[{"role": "user", "content": p}], **chat_kw)
                                .choices[0]) for p in prompts[:3]]
    expected_msg = [blocks_of(claude.messages.create(messages=[{"role": "user", "content": p}], **msg_kw).content)
                    for p in prompts[3:]]

    async def run():
        aoai = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
        aclaude = anthropic.AsyncAnthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)

        async def chat(p):
            stream = await aoai.chat.completions.create(messages=[{"role": "user", "content": p}], stream=True,
                                                        **chat_kw)
            return reassemble_chat_stream([c async for c in stream])["choices"][0]

        async def message(p):
            async with aclaude.messages.stream(messages=[{"role": "user", "content": p}], **msg_kw) as stream:
                return blocks_of((await stream.get_final_message()).content)

        return await asyncio.gather(*[chat(p) for p in prompts[:3]], *[message(p) for p in prompts[3:]])

    results = asyncio.run(run())
    assert results[:3] == expected_chat
    assert results[3:] == expected_msg
