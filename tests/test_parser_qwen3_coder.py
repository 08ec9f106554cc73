"""Core's qwen3_coder tool calls: typed arguments, content around calls, malformed and cut-off calls, any chunking."""
from __future__ import annotations

import json
import random
import re

import pytest

from armillary.parsers.base import ParserPipeline, reduce_events
from armillary.parsers.conformance import check_chunking_invariance, check_event_stream, counting_ids, run_chunks
from armillary.parsers.events import ToolCallArgsDelta, ToolCallEnd, ToolCallStart
from armillary.registry import PluginRegistry

from armillary_qwen_gdn_moe import hooks
from armillary.parsers.qwen3_coder import Qwen3CoderToolParser
from armillary_qwen_gdn_moe.parsers.reasoning import Qwen3ReasoningParser

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city",
        "parameters": {"type": "object", "required": ["city"], "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}, "celsius": {"type": "boolean"}}}}},
    {"type": "function", "function": {
        "name": "write_file", "description": "Write a file",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string"}, "content": {"type": "string"}, "mode": {"type": ["string", "null"]}}}}},
    {"type": "function", "function": {
        "name": "configure", "description": "Settings",
        "parameters": {"type": "object", "properties": {
            "ratio": {"type": "number"}, "options": {"type": "object"}, "tags": {"type": "array"},
            "limit": {"type": "integer"}, "note": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "list_files", "description": "No arguments"}},
]
MARKUP = Qwen3CoderToolParser.markup_strings + ("<think>", "</think>")


def call(name: str, **params: str) -> str:
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


WRITE_CONTENT = 'def greet(name):\n    return f"Hi, {name}!\\n"  # <parameter=x> is not a tag\n\n\tdone\n'

CASES = {
    "content only": (
        "Hello! Note that a < b and 2 > 1, <tool_c is not a tag, nor <function=x>.",
        "Hello! Note that a < b and 2 > 1, <tool_c is not a tag, nor <function=x>.", []),
    "content and one call": (
        "Let me check the weather.\n\n" + call("get_weather", city="Paris", days="3"),
        "Let me check the weather.\n\n", [("get_weather", {"city": "Paris", "days": 3})]),
    "two calls": (
        call("get_weather", city="Paris") + "\n" + call("get_weather", city="Oslo", celsius="false"),
        "", [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo", "celsius": False})]),
    "typed arguments": (
        call("configure", ratio="0.75", options='{"depth": 2, "flags": ["a", "b"]}', tags="['x', 'y']",
             limit="10", note="null"),
        "", [("configure", {"ratio": 0.75, "options": {"depth": 2, "flags": ["a", "b"]}, "tags": ["x", "y"],
                            "limit": 10, "note": None})]),
    "typed arguments that do not parse": (
        call("configure", ratio="about half", limit="ten", options="{broken", celsius="true"),
        "", [("configure", {"ratio": "about half", "limit": "ten", "options": "{broken", "celsius": True})]),
    "string with newlines quotes and unicode": (
        call("write_file", path="/tmp/ü東京 🌸.py", content=WRITE_CONTENT, mode="nullable"),
        "", [("write_file", {"path": "/tmp/ü東京 🌸.py", "content": WRITE_CONTENT, "mode": "nullable"})]),
    "one newline on each side is the format's, as vLLM reads it": (
        call("write_file", content="\nindented\n\n", path=" x "),
        "", [("write_file", {"content": "\nindented\n\n", "path": " x "})]),
    "short strings": (
        call("write_file", path="nu", content="", mode="n"),
        "", [("write_file", {"path": "nu", "content": "", "mode": "n"})]),
    "tool not in tools": (
        call("search_web", query="cats", limit="5", filters='{"safe": true}', raw="not json"),
        "", [("search_web", {"query": "cats", "limit": 5, "filters": {"safe": True}, "raw": "not json"})]),
    "parameter not in schema": (
        call("get_weather", city="Rome", verbose="true"),
        "", [("get_weather", {"city": "Rome", "verbose": True})]),
    "no parameters": (
        "Listing.\n" + call("list_files"), "Listing.\n", [("list_files", {})]),
    "text between and after calls": (
        "First:\n" + call("get_weather", city="A") + "\n\nThen B:\n" + call("get_weather", city="B") + "\n\n",
        "First:\nThen B:\n", [("get_weather", {"city": "A"}), ("get_weather", {"city": "B"})]),
    "two functions in one block": (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nLima\n</parameter>\n</function>\n"
        "<function=list_files>\n</function>\n</tool_call>",
        "", [("get_weather", {"city": "Lima"}), ("list_files", {})]),
    "unterminated call inside a value": (
        "Sure.\n<tool_call>\n<function=write_file>\n<parameter=path>\n/a.txt\n</parameter>\n<parameter=content>\nline 1\n",
        "Sure.\n", [("write_file", {"path": "/a.txt", "content": "line 1"})]),
    "unterminated call on a closing tag": (
        "<tool_call>\n<function=get_weather>\n<parameter=days>\n4\n</param",
        "", [("get_weather", {"days": 4})]),
    "unterminated call on a parameter name": (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nBern\n</parameter>\n<parameter=da",
        "", [("get_weather", {"city": "Bern"})]),
    "unterminated call after the header": (
        "<tool_call>\n<function=list_files>\n", "", [("list_files", {})]),
}

# released as text, markup included (no call could start)
RAW_CASES = {
    "cut-off header": "Checking <tool_call>\n<function=get_wea",
    "cut-off tool_call tag": "Checking <tool_ca",
    "hermes-style JSON body": '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call> ok',
    "empty function name": "<tool_call>\n<function=>\n</function>\n</tool_call>",
    "newline in function name": "<tool_call>\n<function=get\nweather>\n</tool_call>",
}


def tool_pipeline(thinking_open: bool | None = None):
    """A fresh pipeline maker; ``thinking_open=None``: no reasoning parser."""
    def make() -> ParserPipeline:
        reasoner = None if thinking_open is None else Qwen3ReasoningParser(thinking_open)
        return ParserPipeline(reasoner, Qwen3CoderToolParser(TOOLS, counting_ids()))
    return make


def assert_calls(message, expected: list[tuple[str, dict]]) -> None:
    assert [c.name for c in message.tool_calls] == [name for name, _ in expected]
    assert [c.id for c in message.tool_calls] == [f"call_{i}" for i in range(len(expected))]
    for parsed, (_, arguments) in zip(message.tool_calls, expected):
        decoded = json.loads(parsed.arguments)
        # sort_keys dumps tell 1 from 1.0 from true, which == does not
        assert json.dumps(decoded, sort_keys=True) == json.dumps(arguments, sort_keys=True)
        assert parsed.arguments == json.dumps(decoded, ensure_ascii=False)  # the documented separators


@pytest.mark.parametrize("case", list(CASES))
def test_tool_calls_all_chunkings(case):
    text, content, calls = CASES[case]
    forbidden = tuple(m for m in MARKUP if m not in content)  # markup the model wrote as prose may stay
    message = check_chunking_invariance(tool_pipeline(), text, forbidden_in_text=forbidden)
    assert message.content == content
    assert message.reasoning is None
    assert_calls(message, calls)


@pytest.mark.parametrize("case", list(RAW_CASES))
def test_malformed_calls_are_released_as_text(case):
    text = RAW_CASES[case]
    message = check_chunking_invariance(tool_pipeline(), text)
    assert message.content == text
    assert message.tool_calls == []


@pytest.mark.parametrize("thinking_open, text", [
    (True, "The user asks for weather.\n</think>\n\n" + call("get_weather", city="Paris", days="2")),
    (True, "The user asks for weather.\n\n" + call("get_weather", city="Paris", days="2")),  # no </think>
    (False, "<think>\nThe user asks for weather.\n</think>\n\n" + call("get_weather", city="Paris", days="2")),
])
def test_reasoning_then_call(thinking_open, text):
    message = check_chunking_invariance(tool_pipeline(thinking_open), text,
                                        forbidden_in_text=MARKUP)
    assert message.reasoning == "The user asks for weather."
    assert message.content == ""
    assert_calls(message, [("get_weather", {"city": "Paris", "days": 2})])


def test_call_markup_inside_reasoning_is_not_parsed():
    text = "A bare <tool_call> and <parameter=x> in thought.\n</think>\n\nAnswer."
    message = check_chunking_invariance(tool_pipeline(True), text)
    assert message.reasoning == "A bare <tool_call> and <parameter=x> in thought."
    assert message.content == "Answer."
    assert message.tool_calls == []


def test_stream_order_start_then_string_pieces_then_typed_whole():
    parser = Qwen3CoderToolParser(TOOLS, counting_ids())
    assert parser.feed("<tool_call>\n<function=write_fi") == []
    assert parser.feed("le>\n") == [ToolCallStart(0, "call_0", "write_file"), ToolCallArgsDelta(0, "{")]
    assert parser.feed("<parameter=content>\nnu") == []  # could still be the literal null
    assert parser.feed("mber one\n") == [ToolCallArgsDelta(0, '"content": "number one')]
    assert parser.feed("two \"q\"\n</para") == [ToolCallArgsDelta(0, '\\ntwo \\"q\\"')]
    assert parser.feed("meter>\n") == [ToolCallArgsDelta(0, '"')]
    assert parser.feed("<parameter=mode>\nnull\n</parameter>\n") == [ToolCallArgsDelta(0, ', "mode": null')]
    assert parser.feed("</function>\n</tool_call>") == [
        ToolCallArgsDelta(0, "}"), ToolCallEnd(0, '{"content": "number one\\ntwo \\"q\\"", "mode": null}')]
    assert parser.finish() == []


def test_typed_value_goes_out_only_when_complete():
    parser = Qwen3CoderToolParser(TOOLS, counting_ids())
    parser.feed("<tool_call>\n<function=configure>\n<parameter=options>\n{\"a\": ")
    assert parser.feed("[1, 2]}\n") == []
    assert parser.feed("</parameter>") == [ToolCallArgsDelta(0, '"options": {"a": [1, 2]}')]


def test_long_typed_value_in_small_chunks():
    value = json.dumps({"rows": [[i, str(i)] for i in range(300)]})
    text = call("configure", options=value)
    events = run_chunks(tool_pipeline()(), [text[i:i + 2] for i in range(0, len(text), 2)])
    end = [e for e in events if isinstance(e, ToolCallEnd)]
    assert json.loads(end[0].arguments) == {"options": json.loads(value)}


def test_default_ids_and_registration():
    parser = Qwen3CoderToolParser(None)
    events = parser.feed(call("anything", x="1")) + parser.finish()
    start = events[0]
    assert isinstance(start, ToolCallStart) and re.fullmatch(r"call_[A-Za-z0-9]{24}", start.id)
    assert json.loads(events[-1].arguments) == {"x": 1}  # no tools: untyped
    registry = PluginRegistry()  # core's own: no plugin needed (nemotron's template writes it too)
    spec = registry.parsers.get("qwen3_coder")
    assert spec.kind == "tool" and spec.plugin == "core" and spec.load() is Qwen3CoderToolParser
    registry.register(hooks, "qwen_gdn_moe")  # the qwen plugin names it as its default without registering it
    arch = registry.resolve_architecture(["Qwen3_5MoeForCausalLM"])
    assert arch.default_tool_parser == "qwen3_coder" and "qwen3_coder" not in registry.infos["qwen_gdn_moe"].parsers


SOUP = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<function=get_weather>", "<function=configure>",
        "<function=", "</function>", "<parameter=city>", "<parameter=days>", "<parameter=options>", "<parameter=",
        "</parameter>", "\n", "\n\n", " ", "<", ">", "a", "null", "nu", "12", '{"a": 1}', "x < y", "<tool_c",
        "</para", '"', "\\", "東", "=", "true"]


@pytest.mark.parametrize("thinking_open", [None, True, False])
def test_random_markup_soup_is_chunking_invariant(thinking_open):
    """Random mixes of tags, tag fragments and text: every chunking gives the whole-text message."""
    rng = random.Random(1234)
    for _ in range(150):
        text = "".join(rng.choice(SOUP) for _ in range(rng.randint(0, 25)))
        whole = run_chunks(tool_pipeline(thinking_open)(), [text])
        check_event_stream(whole)
        for _ in range(3):
            chunks, pos = [], 0
            while pos < len(text):
                size = rng.randint(1, 6)
                chunks.append(text[pos:pos + size])
                pos += size
            events = run_chunks(tool_pipeline(thinking_open)(), chunks)
            check_event_stream(events)
            assert reduce_events(events) == reduce_events(whole), (text, chunks)
