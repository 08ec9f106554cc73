"""Protocol rendering from scripted parser events and outputs: OpenAI deltas, Anthropic block events, logprobs."""
from __future__ import annotations

import json

import pytest

from armillary.outputs import CompletionOutput, RequestOutput, TokenLogprob
from armillary.parsers.base import ParsedMessage, ParsedToolCall, ParserPipeline
from armillary.parsers.events import ReasoningDelta, TextDelta, ToolCallArgsDelta, ToolCallEnd, ToolCallStart
from armillary.server import anthropic_render as anth
from armillary.server import openai_render as oai
from armillary.server.streaming import OutputDeltas, sse_data, sse_event

TOOL_SCRIPT = [
    ReasoningDelta("The user wants "), ReasoningDelta("weather."),
    TextDelta("\n\n"),
    ToolCallStart(0, "call_a", "get_weather"),
    ToolCallArgsDelta(0, '{"city": '), ToolCallArgsDelta(0, '"Paris"}'),
    ToolCallEnd(0, '{"city": "Paris"}'),
    ToolCallStart(1, "call_b", "get_time"),
    ToolCallEnd(1, '{"tz": "CET"}'),  # a parser may deliver arguments only at the end
]


def reassemble_openai(deltas: list[dict]) -> dict:
    """What a client accumulates from streamed chat deltas."""
    msg = {"content": "", "reasoning_content": "", "tool_calls": {}}
    for d in deltas:
        msg["content"] += d.get("content", "")
        msg["reasoning_content"] += d.get("reasoning_content", "")
        for call in d.get("tool_calls", []):
            slot = msg["tool_calls"].setdefault(call["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in call:
                assert slot["id"] is None, "id sent twice"
                slot["id"], slot["name"] = call["id"], call["function"]["name"]
            slot["arguments"] += call["function"].get("arguments", "")
    return msg


def test_openai_deltas_stream_reasoning_then_tool_calls_without_whitespace_content():
    r = oai.ChatDeltaRenderer()
    deltas = []
    for event in TOOL_SCRIPT:  # one event per step, as a token-by-token stream delivers them
        deltas += r.render([event])
    deltas += r.render([], final=True)
    assert deltas[0] == {"reasoning_content": "The user wants "}
    first_call = next(d for d in deltas if "tool_calls" in d)
    assert first_call == {"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                                          "function": {"name": "get_weather", "arguments": ""}}]}
    msg = reassemble_openai(deltas)
    assert msg["content"] == ""  # the "\n\n" before the call is not content
    assert msg["reasoning_content"] == "The user wants weather."
    assert msg["tool_calls"] == {0: {"id": "call_a", "name": "get_weather", "arguments": '{"city": "Paris"}'},
                                 1: {"id": "call_b", "name": "get_time", "arguments": '{"tz": "CET"}'}}
    assert r.has_tool_calls
    assert oai.finish_reason("stop", r.has_tool_calls) == "tool_calls"
    assert oai.finish_reason("length", r.has_tool_calls) == "length"


def test_openai_deltas_merge_consecutive_events_and_keep_inner_whitespace():
    r = oai.ChatDeltaRenderer()
    deltas = r.render([ReasoningDelta("a"), ReasoningDelta("b"), TextDelta("\n"), TextDelta("Hi"),
                       TextDelta(" there"), TextDelta("\n")])
    assert deltas == [{"reasoning_content": "ab"}, {"content": "\nHi there\n"}]


def test_openai_whitespace_only_content_is_released_at_the_end_without_tool_calls():
    r = oai.ChatDeltaRenderer()
    assert r.render([TextDelta(" ")]) == []
    assert r.render([], final=True) == [{"content": " "}]


def test_openai_chat_message_shapes():
    parsed = ParsedMessage(content="\n", reasoning="why",
                           tool_calls=[ParsedToolCall("call_1", "f", '{"x": 1}')])
    assert oai.chat_message(parsed) == {
        "role": "assistant", "content": None, "reasoning_content": "why",
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}],
    }
    plain = oai.chat_message(ParsedMessage(content="hello", reasoning=None))
    assert plain == {"role": "assistant", "content": "hello"}


def test_openai_logprobs_shapes_and_infinite_values():
    entries = [TokenLogprob(5, -0.5, [(5, -0.5), (7, float("-inf"))]), TokenLogprob(7, -1.25, [])]
    text = {5: "he", 7: "llo"}.__getitem__
    chat = oai.chat_logprobs(entries, text)
    assert chat["content"][0] == {"token": "he", "logprob": -0.5, "bytes": [104, 101], "top_logprobs": [
        {"token": "he", "logprob": -0.5, "bytes": [104, 101]},
        {"token": "llo", "logprob": -9999.0, "bytes": [108, 108, 111]}]}
    assert chat["content"][1]["top_logprobs"] == []
    legacy = oai.completion_logprobs(entries, text, text_offset=3)
    assert legacy == {"tokens": ["he", "llo"], "token_logprobs": [-0.5, -1.25],
                      "top_logprobs": [{"he": -0.5, "llo": -9999.0}, {}], "text_offset": [3, 5]}
    json.dumps(chat, allow_nan=False)  # strict JSON: no -Infinity


def test_openai_chunks_and_usage():
    head = oai.ResponseHeader("chatcmpl-1", 123, "m")
    chunk = oai.chat_chunk(head, 1, {"content": "x"}, with_usage_field=True)
    assert chunk == {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 123, "model": "m",
                     "choices": [{"index": 1, "delta": {"content": "x"}, "logprobs": None, "finish_reason": None}],
                     "usage": None}
    assert oai.usage_chunk(head, "chat.completion.chunk", 4, 6)["usage"] == {
        "prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10, "prompt_tokens_details": {"cached_tokens": 0}}
    assert oai.usage_chunk(head, "chat.completion.chunk", 4, 6, 3)["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 3}
    assert sse_data({"a": "é"}) == 'data: {"a":"é"}\n\n'
    assert sse_event("ping", {"type": "ping"}) == 'event: ping\ndata: {"type":"ping"}\n\n'


def reassemble_anthropic(events: list[tuple[str, dict]]) -> list[dict]:
    """Replay block events the way the Anthropic SDK accumulates them, checking the sequence rules."""
    blocks: list[dict] = []
    open_index = None
    partial: dict[int, str] = {}
    for name, payload in events:
        assert payload["type"] == name
        if name == "content_block_start":
            assert open_index is None and payload["index"] == len(blocks)
            open_index = payload["index"]
            blocks.append(dict(payload["content_block"]))
        elif name == "content_block_delta":
            assert payload["index"] == open_index
            d, block = payload["delta"], blocks[open_index]
            if d["type"] == "text_delta":
                block["text"] += d["text"]
            elif d["type"] == "thinking_delta":
                block["thinking"] += d["thinking"]
            else:
                assert d["type"] == "input_json_delta" and block["type"] == "tool_use"
                partial[open_index] = partial.get(open_index, "") + d["partial_json"]
        elif name == "content_block_stop":
            assert payload["index"] == open_index
            if open_index in partial:
                blocks[open_index]["input"] = json.loads(partial[open_index])
            open_index = None
    assert open_index is None, "a block was left open"
    return blocks


def test_anthropic_block_events_for_thinking_text_and_tool_use():
    r = anth.BlockStreamRenderer()
    events = []
    script = [ReasoningDelta("hmm"), TextDelta("\n\n"), TextDelta("Let me check."), *TOOL_SCRIPT[3:]]
    for event in script:
        events += r.render([event])
    events += r.render([], final=True)
    blocks = reassemble_anthropic(events)
    assert blocks == [
        {"type": "thinking", "thinking": "hmm", "signature": ""},
        {"type": "text", "text": "\n\nLet me check."},
        {"type": "tool_use", "id": "call_a", "name": "get_weather", "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "call_b", "name": "get_time", "input": {"tz": "CET"}},
    ]
    assert r.has_tool_use and r.num_blocks == 4


def test_anthropic_whitespace_between_thinking_and_tool_use_opens_no_block():
    r = anth.BlockStreamRenderer()
    events = r.render(TOOL_SCRIPT, final=True)
    kinds = [p["content_block"]["type"] for n, p in events if n == "content_block_start"]
    assert kinds == ["thinking", "tool_use", "tool_use"]


def test_anthropic_whitespace_only_reply_still_has_a_text_block():
    r = anth.BlockStreamRenderer()
    assert r.render([TextDelta("\n")]) == []
    assert reassemble_anthropic(r.render([], final=True)) == [{"type": "text", "text": "\n"}]


def test_anthropic_whole_message_blocks_and_stop_reasons():
    parsed = ParsedMessage(content=" \n", reasoning="r", tool_calls=[ParsedToolCall("call_1", "f", '{"a": [1]}')])
    assert anth.content_blocks(parsed) == [
        {"type": "thinking", "thinking": "r", "signature": ""},
        {"type": "tool_use", "id": "call_1", "name": "f", "input": {"a": [1]}},
    ]
    assert anth.content_blocks(ParsedMessage(content="hi", reasoning=None)) == [{"type": "text", "text": "hi"}]
    assert anth.tool_input("not json") == {}
    assert anth.stop_reason("length", None, [], True) == ("max_tokens", None)
    assert anth.stop_reason("stop", None, [], True) == ("tool_use", None)
    assert anth.stop_reason("stop", "END", ["END"], False) == ("stop_sequence", "END")
    assert anth.stop_reason("stop", 151645, ["END"], False) == ("end_turn", None)
    name, payload = anth.message_start("msg_1", "m", 12)
    assert name == "message_start" and payload["message"]["usage"]["input_tokens"] == 12
    assert [n for n, _ in anth.message_end("end_turn", None, 3)] == ["message_delta", "message_stop"]


def _output(texts: list[str], ids: list[list[int]], reasons: list[str | None]) -> RequestOutput:
    outs = [CompletionOutput(i, t, tid, r, None, [TokenLogprob(x, -1.0) for x in tid])
            for i, (t, tid, r) in enumerate(zip(texts, ids, reasons))]
    return RequestOutput("r", None, [1, 2], outs, all(r is not None for r in reasons))


def test_output_deltas_per_choice():
    tracker = OutputDeltas()
    first = tracker.update(_output(["a", ""], [[1], [2]], [None, None]))
    assert [(d.index, d.text, d.token_ids) for d in first] == [(0, "a", [1]), (1, "", [2])]
    second = tracker.update(_output(["abc", "x"], [[1, 3], [2, 4]], ["stop", None]))
    assert [(d.index, d.text, d.token_ids, d.finished_now) for d in second] == [
        (0, "bc", [3], True), (1, "x", [4], False)]
    assert [lp.token_id for lp in second[0].logprobs] == [3]
    third = tracker.update(_output(["abc", "xy"], [[1, 3], [2, 4, 5]], ["stop", "length"]))
    assert [(d.index, d.text, d.finish_reason) for d in third] == [(1, "y", "length")]


@pytest.mark.parametrize("chunk", [1, 2, 5, 1000])
def test_real_qwen_parsers_render_the_same_message_streamed_and_whole(chunk):
    """The plugin's qwen3 parsers through both renderers: any chunking gives the non-streaming message."""
    from armillary.parsers.qwen3_coder import Qwen3CoderToolParser
    from armillary_qwen_gdn_moe.parsers.reasoning import Qwen3ReasoningParser

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
    text = ("I should call it.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
            "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")

    def pipeline() -> ParserPipeline:
        ids = iter(["call_x", "call_y"])
        return ParserPipeline(Qwen3ReasoningParser(thinking_open=True), Qwen3CoderToolParser(tools, lambda: next(ids)))

    whole = pipeline().parse_complete(text)
    streamed_pipeline, openai_r, anth_r = pipeline(), oai.ChatDeltaRenderer(), anth.BlockStreamRenderer()
    deltas, block_events = [], []
    for i in range(0, len(text), chunk):
        events = streamed_pipeline.feed(text[i:i + chunk])
        deltas += openai_r.render(events)
        block_events += anth_r.render(events)
    events = streamed_pipeline.finish()
    deltas += openai_r.render(events, final=True)
    block_events += anth_r.render(events, final=True)

    msg = reassemble_openai(deltas)
    assert oai.chat_message(whole) == {
        "role": "assistant", "content": None, "reasoning_content": "I should call it.",
        "tool_calls": [{"id": "call_x", "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]}
    assert msg["reasoning_content"] == whole.reasoning and msg["content"] == ""
    assert msg["tool_calls"][0]["arguments"] == whole.tool_calls[0].arguments
    assert reassemble_anthropic(block_events) == anth.content_blocks(whole)
