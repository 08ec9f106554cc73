"""Parser contracts: scanning helpers, argument typing, the generic think parser, the pipeline."""
from __future__ import annotations

import json
import re

import pytest

from armillary.parsers.arg_types import convert_argument, is_string_schema, schema_types
from armillary.parsers.base import (
    ParsedMessage,
    ParsedToolCall,
    ParserPipeline,
    ToolParser,
    new_tool_call_id,
    reduce_events,
)
from armillary.parsers.conformance import (
    check_chunking_invariance,
    check_event_stream,
    chunkings,
    counting_ids,
    run_chunks,
)
from armillary.parsers.events import (
    ParserEvent,
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from armillary.parsers.scan import find_first_tag, partial_tag_len, undecided_prefix
from armillary.parsers.think import ThinkReasoningParser

THINK_MARKUP = ("<think>", "</think>")


class BracketToolParser(ToolParser):
    """A minimal tool format for pipeline tests: ``[[name]]`` is a call without arguments."""

    markup_strings = ("[[", "]]", "</think>")

    def __init__(self, tools: list[dict] | None, id_generator=None) -> None:
        super().__init__(tools, id_generator)
        self._buf = ""
        self._calls = 0

    def feed(self, delta: str) -> list[ParserEvent]:
        self._buf += delta
        return self._drain(final=False)

    def finish(self) -> list[ParserEvent]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[ParserEvent]:
        events: list[ParserEvent] = []
        while True:
            buf = self._buf
            start = buf.find("[[")
            end = buf.find("]]", start) if start >= 0 else -1
            if end < 0:
                cut = len(buf) if final else (start if start >= 0 else len(buf) - partial_tag_len(buf, ("[[",)))
                if cut:
                    events.append(TextDelta(buf[:cut]))
                self._buf = buf[cut:]
                return events
            if start:
                events.append(TextDelta(buf[:start]))
            events += [ToolCallStart(self._calls, self.id_generator(), buf[start + 2:end]),
                       ToolCallArgsDelta(self._calls, "{}"), ToolCallEnd(self._calls, "{}")]
            self._calls += 1
            self._buf = buf[end + 2:]


# -- scanning -------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, tags, expected", [
    ("hello <", ("<tool_call>",), 1),
    ("hello <tool_c", ("<tool_call>",), 7),
    ("hello <tool_call>", ("<tool_call>",), 0),  # complete: not partial
    ("a < b", ("<tool_call>",), 0),
    ("x</", ("<think>", "</think>"), 2),
    ("x<", ("<think>", "</think>"), 1),
    ("", ("<think>",), 0),
    ("<<", ("<<a",), 2),
])
def test_partial_tag_len(text, tags, expected):
    assert partial_tag_len(text, tags) == expected


def test_find_first_tag_and_undecided_prefix():
    assert find_first_tag("a</p><p>", ("<p>", "</p>")) == (1, "</p>")
    assert find_first_tag("ab<x>", ("<x>", "<x")) == (2, "<x>")  # tie: the longest
    assert find_first_tag("abc", ("<x>",)) is None
    assert find_first_tag("<x>..<x>", ("<x>",), start=1) == (5, "<x>")
    assert undecided_prefix("\n <func", "<function=")
    assert undecided_prefix("  ", "<function=")
    assert not undecided_prefix("<function=", "<function=")  # complete: decided
    assert not undecided_prefix("<fun x", "<function=")


def test_tool_call_id_shape():
    ids = {new_tool_call_id() for _ in range(20)}
    assert len(ids) == 20
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids)


# -- argument typing ------------------------------------------------------------------------------

STR, INT, NUM, BOOL = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}
OBJ, ARR = {"type": "object"}, {"type": "array"}


@pytest.mark.parametrize("raw, schema, expected", [
    ("hello", STR, "hello"),
    ("42", STR, "42"),
    ("  spaced  ", STR, "  spaced  "),
    ("null", STR, None),
    ("42", INT, 42),
    (" 42 ", INT, 42),
    ("-7", INT, -7),
    ("5.0", INT, 5),
    ("5.5", INT, "5.5"),
    ("forty", INT, "forty"),
    ("3.25", NUM, 3.25),
    ("3", NUM, 3),
    (".5", NUM, 0.5),
    ("1e3", NUM, 1000.0),
    ("nan", NUM, "nan"),
    ("True", BOOL, True),
    ("false", BOOL, False),
    ("yes", BOOL, "yes"),
    ("null", INT, None),
    ('{"a": [1, 2]}', OBJ, {"a": [1, 2]}),
    ("{'a': (1, 2), 'b': True, 'c': None}", OBJ, {"a": [1, 2], "b": True, "c": None}),
    ("[1, 2]", OBJ, "[1, 2]"),
    ("[1, 'x']", ARR, [1, "x"]),
    ("{1, 2}", ARR, "{1, 2}"),  # a Python set has no JSON form
    ("not json", ARR, "not json"),
    ("7", {"type": ["integer", "null"]}, 7),
    ("7", {"anyOf": [{"type": "string"}, {"type": "integer"}]}, "7"),
    ("7", {"enum": ["7", "8"]}, "7"),
    ("7", {"enum": [7, 8]}, 7),
    ('{"k": 1}', {"properties": {"k": {}}}, {"k": 1}),
    ("12", None, 12),
    ("[true]", {}, [True]),
    ("plain words", None, "plain words"),
    ("NaN", None, "NaN"),
])
def test_convert_argument(raw, schema, expected):
    value = convert_argument(raw, schema)
    assert value == expected and type(value) is type(expected)
    json.dumps(value, allow_nan=False)  # always representable as JSON


def test_schema_types():
    assert schema_types({"type": "STRING"}) == {"string"}
    assert schema_types({"type": ["string", "null"]}) == {"string", "null"}
    assert schema_types({"items": {}}) == {"array"}
    assert schema_types(None) == set()
    assert is_string_schema({"type": ["null", "string"]})
    assert not is_string_schema({"type": "integer"})
    assert not is_string_schema(None)


# -- generic think parser -------------------------------------------------------------------------

def think_pipeline(thinking_open: bool):
    return lambda: ParserPipeline(ThinkReasoningParser(thinking_open), None)


@pytest.mark.parametrize("thinking_open, text, reasoning, content", [
    (True, "Let me see.\n</think>\n\nAnswer.", "Let me see.", "Answer."),
    (True, "Still thinking\n\nabout it", "Still thinking\n\nabout it", ""),
    (True, "\n\nR\n\nS\n\n", "R\n\nS\n\n", ""),  # unterminated: held newlines flushed at the end
    (True, "<think>\nR</think>\n\nA", "R", "A"),  # the model opened it again itself
    (True, "a < b, </thin k> and <thinking>\n</think>\nx < y", "a < b, </thin k> and <thinking>", "x < y"),
    (True, "</think>\n\nOnly content", None, "Only content"),
    (True, "R\n</thi", "R\n</thi", ""),  # a cut-off end tag is reasoning text
    (True, "R</think>A\n\n</think>", "R", "A\n\n</think>"),  # only the first end tag is markup
    (False, "<think>\nR\n</think>\n\nA", "R", "A"),
    (False, " \n<think>R</think>A", "R", "A"),
    (False, "Plain answer.", None, "Plain answer."),
    (False, "<thinking> is not a tag", None, "<thinking> is not a tag"),
    (False, "\n\nHello", None, "\n\nHello"),
    (False, "<thi", None, "<thi"),
    (False, "a <think> later is text", None, "a <think> later is text"),
])
def test_think_parser_all_chunkings(thinking_open, text, reasoning, content):
    message = check_chunking_invariance(think_pipeline(thinking_open), text)
    assert message == ParsedMessage(content=content, reasoning=reasoning, tool_calls=[])


def test_think_parser_streams_reasoning_before_the_end():
    parser = ThinkReasoningParser(thinking_open=True)
    assert parser.feed("First idea. ") == [ReasoningDelta("First idea. ")]
    assert parser.feed("Then\n") == [ReasoningDelta("Then")]  # the newline may precede </think>
    assert parser.feed("</th") == []
    assert parser.feed("ink>\n\nHi") == [TextDelta("Hi")]
    assert parser.finish() == []


def test_prompt_opens_reasoning():
    assert ThinkReasoningParser.prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not ThinkReasoningParser.prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not ThinkReasoningParser.prompt_opens_reasoning("<|im_start|>assistant\n")
    assert ThinkReasoningParser.prompt_opens_reasoning("<think>old</think> ... <think>\n")


# -- pipeline -------------------------------------------------------------------------------------

def bracket_pipeline(thinking_open: bool | None):
    def make() -> ParserPipeline:
        reasoning = None if thinking_open is None else ThinkReasoningParser(thinking_open)
        return ParserPipeline(reasoning, BracketToolParser(None, counting_ids()))
    return make


def test_pipeline_leaves_calls_inside_reasoning_alone():
    text = "I could use [[draft]] here.\n</think>\n\nChecking [[lookup]] now [[fetch]]"
    message = check_chunking_invariance(bracket_pipeline(True), text, forbidden_in_text=("[[", "]]", "</think>"))
    assert message.reasoning == "I could use [[draft]] here."
    assert message.content == "Checking  now "
    assert message.tool_calls == [ParsedToolCall("call_0", "lookup", "{}"), ParsedToolCall("call_1", "fetch", "{}")]


def test_pipeline_without_reasoning_parser_and_without_any_parser():
    message = check_chunking_invariance(bracket_pipeline(None), "a [b] [[c]] d")
    assert message == ParsedMessage("a [b]  d", None, [ParsedToolCall("call_0", "c", "{}")])
    bare = ParserPipeline(None, None)
    assert bare.feed("") == []
    assert bare.feed("<think>x") == [TextDelta("<think>x")]
    assert bare.finish() == []


def test_parse_complete_matches_streaming():
    text = "plan</think>go [[run]]"
    whole = ParserPipeline(ThinkReasoningParser(True), BracketToolParser(None, counting_ids())).parse_complete(text)
    streamed = reduce_events(run_chunks(bracket_pipeline(True)(), list(text)))
    assert whole == streamed == ParsedMessage("go ", "plan", [ParsedToolCall("call_0", "run", "{}")])


def test_pipeline_markup_strings_are_merged_once():
    pipeline = ParserPipeline(ThinkReasoningParser(False), BracketToolParser(None))
    assert pipeline.markup_strings == ("<think>", "</think>", "[[", "]]")
    assert ParserPipeline(None, None).markup_strings == ()


def test_tool_parser_reads_function_schemas():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "g"}}, {"type": "other"}]
    parser = BracketToolParser(tools)
    assert parser.parameter_schemas == {"f": {"type": "object"}, "g": {}}


# -- conformance helpers catch broken streams -----------------------------------------------------

def test_chunkings_cover_every_split():
    labels = [label for label, chunks in chunkings("abcd") if "".join(chunks) == "abcd"]
    assert labels[:5] == ["whole", "split@1", "split@2", "split@3", "chars"]
    assert len(labels) == 5 + 4


@pytest.mark.parametrize("events, problem", [
    ([TextDelta("")], "empty"),
    ([TextDelta("x<think>")], "leaked"),
    ([ToolCallStart(1, "c", "f")], "index"),
    ([ToolCallArgsDelta(0, "{}")], "outside"),
    ([ToolCallStart(0, "c", "f"), ToolCallArgsDelta(0, "{")], "never ended"),
    ([ToolCallStart(0, "c", "f"), ToolCallArgsDelta(0, "{"), ToolCallEnd(0, "{}")], "!="),
    ([ToolCallStart(0, "c", "f"), ToolCallArgsDelta(0, "[]"), ToolCallEnd(0, "[]")], "not a JSON object"),
])
def test_check_event_stream_rejects(events, problem):
    with pytest.raises(AssertionError, match=problem):
        check_event_stream(events, forbidden_in_text=THINK_MARKUP)


def test_chunking_invariance_detects_a_chunking_dependent_parser():
    class FirstChunkOnly(ThinkReasoningParser):
        """Broken on purpose: treats only the first delta as reasoning."""

        def feed(self, delta):
            first, self.thinking_open = self.thinking_open, False
            return [ReasoningDelta(delta) if first else TextDelta(delta)] if delta else []

        def finish(self):
            return []

    with pytest.raises(AssertionError, match="whole-text"):
        check_chunking_invariance(lambda: ParserPipeline(FirstChunkOnly(True), None), "abc")
