"""Gemma 4 tool calls and thinking blocks as its chat template writes them, over any chunking; the forced-call
grammar read back by the parser with arguments valid against their schemas; Gemma 3 on core's forced JSON."""
from __future__ import annotations

import json

import jsonschema
import pytest

from armillary.parsers.base import ParserPipeline
from armillary.parsers.conformance import check_chunking_invariance, counting_ids
from armillary.parsers.forced_json import ForcedJsonToolParser
from armillary.structured.spec import ToolCallConstraint
from armillary_gemma.parsers.gemma4_syntax import QUOTE as Q
from armillary_gemma.parsers.gemma4_tool import Gemma4ToolParser
from armillary_gemma.parsers.reasoning import Gemma4ReasoningParser

MARKUP = ("<|tool_call>", "<tool_call|>", Q, "<|tool_response>", "<|channel>", "<channel|>")


def _pipeline(thinking_open: bool = False, reasoning: bool = True):
    return lambda: ParserPipeline(Gemma4ReasoningParser(thinking_open) if reasoning else None,
                                  Gemma4ToolParser(TOOLS, id_generator=counting_ids()))


def _parse(text: str, forbidden=MARKUP, **kw):
    return check_chunking_invariance(_pipeline(**kw), text, forbidden)


def _args(message) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in message.tool_calls]


def test_thinking_block_with_its_channel_name_then_content():
    m = _parse("<|channel>thought\nLet me think: 2 + 2.\n<channel|>It is 4.")
    assert (m.reasoning, m.content, m.tool_calls) == ("Let me think: 2 + 2.", "It is 4.", [])


def test_empty_thinking_block_and_plain_content():
    assert _parse("<|channel>thought\n<channel|>Hello there").content == "Hello there"
    m = _parse("Just an answer, thoughtfully.")
    assert (m.reasoning, m.content) == (None, "Just an answer, thoughtfully.")


def test_thinking_left_open_by_the_prompt():
    m = _parse("weighing options<channel|>done", thinking_open=True)
    assert (m.reasoning, m.content) == ("weighing options", "done")
    assert not Gemma4ReasoningParser.prompt_opens_reasoning("<|turn>model\n<|channel>thought\n<channel|>")
    assert Gemma4ReasoningParser.prompt_opens_reasoning("<|turn>model\n<|channel>thought\n")


def test_one_call_as_the_template_writes_it():
    text = f"<|tool_call>call:get_weather{{city:{Q}Paris, France{Q},days:3}}<tool_call|><|tool_response>"
    m = _parse(text)
    assert m.content == "" and _args(m) == [("get_weather", {"city": "Paris, France", "days": 3})]


def test_reasoning_then_text_then_parallel_calls_with_nested_values():
    text = (f"<|channel>thought\nneed two calls\n<channel|>Checking.<|tool_call>call:get_weather{{city:{Q}Oslo{Q},"
            f"days:1,opts:{{hourly:true}}}}<tool_call|>\n<|tool_call>call:lookup{{count:null,ids:[1,2],"
            f"key:{Q}a}}b<tool_call|>c{Q},word:{Q}{Q}}}<tool_call|>")
    m = _parse(text, forbidden=MARKUP[:2] + MARKUP[3:])
    assert m.reasoning == "need two calls" and m.content == "Checking."
    assert _args(m) == [("get_weather", {"city": "Oslo", "days": 1, "opts": {"hourly": True}}),
                        ("lookup", {"count": None, "ids": [1, 2], "key": "a}b<tool_call|>c", "word": ""})]


def test_two_calls_in_one_block_and_text_after_the_calls():
    text = f"<|tool_call>call:ping{{}},call:ping{{n:{Q}x{Q}}}<tool_call|>\n\nAnything else?"
    m = _parse(text)
    assert _args(m) == [("ping", {}), ("ping", {"n": "x"})] and m.content == "\n\nAnything else?"


def test_malformed_or_cut_off_blocks_are_content():
    bad = "<|tool_call>call:get_weather{city Paris}<tool_call|> and more"
    m = _parse(bad, forbidden=())
    assert m.tool_calls == [] and m.content == bad
    cut = f"Sure.<|tool_call>call:get_weather{{city:{Q}Pa"
    m = _parse(cut, forbidden=())
    assert m.tool_calls == [] and m.content == cut


def test_a_complete_call_whose_end_tag_was_a_stop_token():
    m = _parse(f"<|tool_call>call:lookup{{key:{Q}abc{Q},count:2,word:{Q}hi{Q}}}")
    assert _args(m) == [("lookup", {"key": "abc", "count": 2, "word": "hi"})]


# ---- the forced-call grammar, sampled uniformly over its allowed tokens

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8}, "days": {"type": "integer"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "opts": {"type": "object", "properties": {"hourly": {"type": "boolean"}}, "required": ["hourly"]}},
        "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {
        "key": {"type": "string", "minLength": 2, "maxLength": 5}, "count": {"type": ["integer", "null"]},
        "word": {"type": "string", "maxLength": 4},
        "ids": {"type": "array", "items": {"type": "number"}}},
        "required": ["key", "count", "word"]}}},
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
NAMES = tuple(SCHEMAS)


@pytest.fixture(scope="module")
def walker(tmp_path_factory):
    from armillary.tokenizer import Tokenizer
    from tests.fixtures.tiny_tokenizer import make_qwen_tokenizer
    from tests.test_structured_grammar import VOCAB, GrammarWalker

    path = tmp_path_factory.mktemp("walk_tokenizer")
    make_qwen_tokenizer(path, vocab_size=VOCAB)
    return GrammarWalker(Tokenizer.from_pretrained(path))


@pytest.mark.parametrize("constraint", [
    ToolCallConstraint(True, NAMES, frozenset(NAMES), parallel=True),
    ToolCallConstraint(True, ("lookup",), frozenset({"lookup"}), parallel=False),
], ids=["required-parallel", "named"])
def test_forced_calls_parse_and_validate(walker, constraint):
    spec = Gemma4ToolParser.tool_call_grammar(TOOLS, constraint)
    outputs = walker.sample(spec, 120, 600)
    texts = [t for t, done in outputs if done]
    assert len(texts) >= 100
    counts = []
    for text in texts:
        m = ParserPipeline(None, Gemma4ToolParser(TOOLS)).parse_complete(text)
        assert m.content.strip() == "" and m.tool_calls, text
        counts.append(len(m.tool_calls))
        for call in m.tool_calls:
            assert call.name in constraint.allowed
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert (max(counts) > 1) if constraint.parallel else set(counts) == {1}


def test_gemma3_serves_forced_calls_through_cores_json_grammar(gemma_registry):
    """Gemma 3 has no tool parser: forced calls use core's forced-JSON grammar and reader."""
    arch = next(a for a in gemma_registry.architectures if a.name == "gemma3")
    assert arch.default_tool_parser is None
    constraint = ToolCallConstraint(True, NAMES, frozenset(NAMES))
    assert ForcedJsonToolParser.tool_call_grammar(TOOLS, constraint) is not None
    reply = '[{"name": "get_weather", "parameters": {"city": "Rome", "days": 2}}]'
    m = ParserPipeline(None, ForcedJsonToolParser(TOOLS)).parse_complete(reply)
    assert [(c.name, json.loads(c.arguments)) for c in m.tool_calls] == [("get_weather", {"city": "Rome", "days": 2})]
