"""JSON tool calls: the strict scanner, the hermes / llama3_json parsers and forced calls without a parser, over any
chunking; their grammars read back by their parsers, arguments valid against the schemas."""
from __future__ import annotations

import json
import random

import jsonschema
import pytest

from armillary.parsers.base import ParserPipeline
from armillary.parsers.conformance import check_chunking_invariance, counting_ids
from armillary.parsers.forced_json import ForcedJsonToolParser
from armillary.parsers.json_grammar import forced_json_schema, forced_single_tool
from armillary.parsers.json_scan import JsonScanner
from armillary.parsers.json_tools import HermesToolParser, Llama3JsonToolParser
from armillary.registry import PluginRegistry
from armillary.structured.spec import ToolCallConstraint
from tests.test_structured_grammar import finished, walker  # noqa: F401 (walker is a fixture)

HERMES_MARKUP = ("<tool_call>", "</tool_call>")


def pipeline(parser_cls, **kw):
    return lambda: ParserPipeline(None, parser_cls(None, counting_ids(), **kw))


def calls_of(message) -> list[tuple[str, object]]:
    assert [c.id for c in message.tool_calls] == [f"call_{i}" for i in range(len(message.tool_calls))]
    return [(c.name, json.loads(c.arguments)) for c in message.tool_calls]


# ---- the scanner

def _random_value(rng: random.Random, depth: int = 0):
    kind = rng.randint(0, 6 if depth < 3 else 3)
    if kind == 0:
        return rng.choice([0, -1, 12, 3.5, -2e-5, 1e10, 10 ** 20])
    if kind == 1:
        return rng.choice(["", 'a"b', "é\\", "\n\t\u0001", "東京 🌸", "x" * 5])
    if kind == 2:
        return rng.choice([True, False, None])
    if kind <= 4:
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(["a", "b c", "é", ""]) + str(i): _random_value(rng, depth + 1) for i in range(rng.randint(0, 3))}


def test_scanner_last_safe_prefix_always_closes_to_valid_json():
    rng = random.Random(7)
    for _ in range(300):
        text = json.dumps({"v": _random_value(rng)}, ensure_ascii=rng.random() < 0.5,
                          indent=rng.choice([None, 2]), separators=rng.choice([None, (",", ":")]))
        scanner, last_safe = JsonScanner(), 0
        for i, char in enumerate(text):
            assert scanner.step(char), (text, i)
            if scanner.safe:
                last_safe = i + 1
            json.loads(text[:last_safe] + scanner.closers(0))
        assert scanner.done and last_safe == len(text)


@pytest.mark.parametrize("text", ['{"a": 01}', '{"a": 1,}', "[tru]", '{"a"}', '{"a": -}', "[1 2]", '{"a": NaN}',
                                  "{'a': 1}", '["\x01"]', '{"a": 1}}'])
def test_scanner_rejects_what_json_does_not_allow(text):
    scanner = JsonScanner()
    assert not all(scanner.step(c) for c in text) or not scanner.done
    with pytest.raises(ValueError):  # Python's json, told that NaN is no JSON, agrees
        json.loads(text, parse_constant=lambda name: (_ for _ in ()).throw(ValueError(name)))


# ---- hermes

HERMES_CASES = {
    "content, two calls, content": (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2.5e3, '
        '{"x": "y\\"z\\u00e9 東"}]}}\n</tool_call>\n<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>\n\nDone.',
        "Let me check.\nDone.", [("get_weather", {"city": "Paris", "days": [1, 2500.0, {"x": 'y"zé 東'}]}),
                                 ("ping", {})]),
    "arguments before the name, compact": (
        '<tool_call>{"arguments":{"a":1},"name":"late"}</tool_call>', "", [("late", {"a": 1})]),
    "arguments as a JSON string": (
        '<tool_call>\n{"name": "s", "arguments": "{\\"q\\": 1}"}\n</tool_call>', "", [("s", {"q": 1})]),
    "parameters key, no arguments at all": (
        '<tool_call>\n{"name": "a", "parameters": {"k": null}}\n</tool_call><tool_call>{"name": "b"}</tool_call>',
        "", [("a", {"k": None}), ("b", {})]),
    "cut inside a string escape": (
        'x <tool_call>\n{"name": "cut", "arguments": {"a": "abc\\u00', "x ", [("cut", {"a": "abc"})]),
    "cut inside a key": (
        'x <tool_call>\n{"name": "cut", "arguments": {"a": 1, "b', "x ", [("cut", {"a": 1})]),
    "cut inside a number": (
        '<tool_call>{"name": "n", "arguments": {"a": [1, 2.', "", [("n", {"a": [1, 2]})]),
    "broken JSON after the start": (
        '<tool_call>\n{"name": "br", "arguments": {"a": [1], "b": tru}}\n</tool_call> tail',
        "tail", [("br", {"a": [1]})]),
    "cut after the name": ('<tool_call>{"name": "x", "argu', "", [("x", {})]),
    "unclosed block, then another": (
        '<tool_call>{"name": "a", "arguments": {}} junk <tool_call>{"name": "b", "arguments": {}}</tool_call>',
        "", [("a", {}), ("b", {})]),
}

HERMES_TEXT = [
    '<tool_call>\n{"answer": 42}\n</tool_call> after',  # a JSON object that is no call
    "<tool_call> not json </tool_call>",
    '<tool_call>{"name": 5}</tool_call>',
    '<tool_call>{"name": ""}</tool_call>',
    "<tool_c", "a < b <tool_call", "plain text only",
    '<tool_call>{"argu',  # cut before a name: no call
]


@pytest.mark.parametrize("case", list(HERMES_CASES))
def test_hermes_calls_all_chunkings(case):
    text, content, calls = HERMES_CASES[case]
    message = check_chunking_invariance(pipeline(HermesToolParser), text, forbidden_in_text=HERMES_MARKUP)
    assert message.content == content
    assert calls_of(message) == calls


@pytest.mark.parametrize("text", HERMES_TEXT)
def test_hermes_non_calls_are_content_verbatim(text):
    message = check_chunking_invariance(pipeline(HermesToolParser), text)
    assert message.content == text and not message.tool_calls


def test_hermes_streams_arguments_as_they_come():
    parser = HermesToolParser(None, counting_ids())
    assert parser.feed('<tool_call>\n{"name": "w", "argu') == []
    started = parser.feed('ments": {"city": "Par')
    assert type(started[0]).__name__ == "ToolCallStart" and started[0].name == "w"
    assert "".join(e.delta for e in started[1:]) == '{"city": "Par'
    assert parser.feed('is"') [0].delta == 'is"'
    assert parser.feed(", ") == []  # a comma cannot end a safe prefix
    end = parser.feed('"days": 3}}\n</tool_call>')
    assert end[-1].arguments == '{"city": "Paris", "days": 3}'


# ---- llama3_json

LLAMA_CASES = {
    "python tag, two calls": (
        '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}',
        "", [("a", {"x": 1}), ("b", {})]),
    "leading whitespace, text after": (
        '  {"name": "a", "parameters": {"x": "y"}}\n\nThanks', "Thanks", [("a", {"x": "y"})]),
    "arguments key, calls without separator": (
        '{"name": "a", "arguments": {}}\n{"name": "b", "parameters": {"k": [true]}}', "",
        [("a", {}), ("b", {"k": [True]})]),
    "cut inside the arguments": ('{"name": "a", "parameters": {"x": [1, 2', "", [("a", {"x": [1, 2]})]),
    "dangling separator": ('{"name": "a", "parameters": {}};', "", [("a", {})]),
    "second object is no call": (
        '{"name": "a", "parameters": {}}; {"answer": 1}', '; {"answer": 1}', [("a", {})]),
}

LLAMA_TEXT = ['Hello {"name": "a", "parameters": {}}', '{"answer": 1}', "<|python", "<|python_tag|>print(1)",
              '{"name": "Bob", "age": 3}', "", "   "]


@pytest.mark.parametrize("case", list(LLAMA_CASES))
def test_llama3_json_calls_all_chunkings(case):
    text, content, calls = LLAMA_CASES[case]
    message = check_chunking_invariance(pipeline(Llama3JsonToolParser), text)
    assert message.content == content
    assert calls_of(message) == calls


@pytest.mark.parametrize("text", LLAMA_TEXT)
def test_llama3_json_replies_that_open_otherwise_are_content(text):
    message = check_chunking_invariance(pipeline(Llama3JsonToolParser), text)
    assert message.content == text and not message.tool_calls


# ---- forced calls without a parser

def test_forced_array_and_single_forms_all_chunkings():
    array = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {"y": "z\\n"}}]'
    message = check_chunking_invariance(pipeline(ForcedJsonToolParser), array)
    assert message.content == "" and calls_of(message) == [("a", {"x": 1}), ("b", {"y": "z\n"})]
    cut = check_chunking_invariance(pipeline(ForcedJsonToolParser), '\n[{"name": "a", "parameters": {"x": "ab')
    assert calls_of(cut) == [("a", {"x": "ab"})]
    single = check_chunking_invariance(pipeline(ForcedJsonToolParser, single="pick"), ' {"k": [1, {"j": null}]}')
    assert single.content == "" and calls_of(single) == [("pick", {"k": [1, {"j": None}]})]
    for text in ("no json", '{"not": "an array"}'):
        assert check_chunking_invariance(pipeline(ForcedJsonToolParser), text).content == text


def test_forced_schema_shapes():
    tools = [{"type": "function", "function": {"name": "a", "parameters": {
        "$defs": {"p": {"type": "integer"}}, "type": "object", "properties": {"x": {"$ref": "#/$defs/p"}}}}},
        {"type": "function", "function": {"name": "b"}}]
    required = ToolCallConstraint(True, ("a", "b"), frozenset({"a", "b"}), parallel=False)
    schema = forced_json_schema(tools, required)
    assert schema["maxItems"] == 1 and schema["$defs"] == {"p": {"type": "integer"}}
    jsonschema.validate([{"name": "a", "parameters": {"x": 3}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "a", "parameters": {"x": "3"}}], schema)
    named = ToolCallConstraint(True, ("b",), frozenset({"b"}), parallel=False)
    assert forced_single_tool(named) == "b" and forced_json_schema(tools, named) == {"type": "object",
                                                                                    "properties": {}}


def test_core_registers_the_json_parsers():
    from armillary import core_plugin

    registry = PluginRegistry()
    registry.register(core_plugin, "core")
    assert registry.parsers.get("hermes").load() is HermesToolParser
    assert registry.parsers.get("llama3_json").load() is Llama3JsonToolParser
    assert {p.name for p in registry.parsers.of_kind("tool")} >= {"hermes", "llama3_json"}


# ---- grammars, read back by their parsers

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "unit": {"enum": ["c", "f"]}}, "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {
        "ids": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
        "q": {"type": ["string", "null"], "maxLength": 4}}, "required": ["ids", "q"]}}},
    {"type": "function", "function": {"name": "ping"}},
]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object", "properties": {}})
           for t in TOOLS}
NAMES = tuple(SCHEMAS)
CONSTRAINTS = {
    "required-parallel": ToolCallConstraint(True, NAMES, frozenset(NAMES), parallel=True),
    "required-single": ToolCallConstraint(True, NAMES, frozenset(NAMES), parallel=False),
    "named": ToolCallConstraint(True, ("lookup",), frozenset({"lookup"}), parallel=False),
}
PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser, "no parser": ForcedJsonToolParser}


@pytest.mark.parametrize("constraint", list(CONSTRAINTS))
@pytest.mark.parametrize("fmt", list(PARSERS))
def test_forced_grammars_read_back_valid_calls(walker, fmt, constraint):
    parser_cls, constraint = PARSERS[fmt], CONSTRAINTS[constraint]
    spec = parser_cls.tool_call_grammar(TOOLS, constraint)
    kw = {"single": forced_single_tool(constraint)} if parser_cls is ForcedJsonToolParser else {}
    counts = []
    for text in finished(walker.sample(spec, 80, 300), at_least=70):
        message = ParserPipeline(None, parser_cls(TOOLS, **kw)).parse_complete(text)
        assert message.content.strip() == "" and message.tool_calls, text
        counts.append(len(message.tool_calls))
        for call in message.tool_calls:
            assert call.name in constraint.allowed
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert max(counts) > 1 if constraint.parallel else set(counts) == {1}


AUTO_TEXTS = {  # (text, whether the auto-strict grammar admits it)
    "hermes": [
        ('Sure. <tool_call>\n{"name": "lookup", "arguments": {"ids": [1, 2], "q": null}}\n</tool_call> done', True),
        ('<tool_call>\n{"name": "lookup", "arguments": {"ids": "1", "q": null}}\n</tool_call>', False),
        ('<tool_call>\n{"name": "ping", "arguments": {"any": ["thing"]}}\n</tool_call>', True),
        ('<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>', False),
        ("just text", True)],
    "llama3_json": [
        ('{"name": "lookup", "parameters": {"ids": [], "q": "ab"}}; {"name": "ping", "parameters": {}}', True),
        ('{"name": "lookup", "parameters": {"ids": [], "q": "abcdef"}}', False),
        ("Hello, no call here {x}", True),
        ("  \n", True),
        ("{oops", False)],
}


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json"])
def test_auto_strict_grammars_constrain_the_calls_the_model_opens(walker, fmt):
    import xgrammar as xgr

    parser_cls = PARSERS[fmt]
    constraint = ToolCallConstraint(False, NAMES, frozenset({"lookup"}), parallel=True)
    spec = parser_cls.tool_call_grammar(TOOLS, constraint)
    compiled = walker.outputs.compile(spec)
    for text, admitted in AUTO_TEXTS[fmt]:
        matcher = xgr.GrammarMatcher(compiled)
        assert (matcher.accept_string(text) and matcher.is_completed()) == admitted, text
    for text in finished(walker.sample(spec, 60, 120), at_least=1):  # whatever it lets through parses
        for call in ParserPipeline(None, parser_cls(TOOLS)).parse_complete(text).tool_calls:
            schema = SCHEMAS["lookup"] if call.name == "lookup" else {"type": "object"}
            jsonschema.validate(json.loads(call.arguments), schema)
