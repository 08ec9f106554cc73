"""Structured output through the engine, with a tiny random-weight Qwen3-Next whose free output is noise.

Every case samples 50 requests in one batch (temperature 1, a seed each) and requires all 50 to
finish within max_tokens and to parse and validate; forced tool calls go through the qwen3_coder
parser and the OpenAI / Anthropic renderers.
"""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from armillary import LLM, SamplingParams
from armillary.errors import InvalidRequestError
from armillary.parsers.base import ParserPipeline
from armillary.server.anthropic_render import content_blocks
from armillary.server.openai_render import chat_message
from armillary.structured.spec import StructuredSpec, ToolCallConstraint
from armillary.parsers.qwen3_coder import Qwen3CoderToolParser
from armillary_qwen_gdn_moe.parsers.reasoning import Qwen3ReasoningParser
from plugins.qwen_gdn_moe.tests.harness import qwen_registry
from tests.fixtures.tiny_models import save_tiny_model

N = 50
PROMPT = "Reply in JSON."


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    path = tmp_path_factory.mktemp("structured_tiny")
    save_tiny_model(path)
    return LLM(str(path), registry=qwen_registry(), dtype="float32", max_model_len=1024, max_num_seqs=N)


def sample(spec: StructuredSpec, max_tokens: int, **kw) -> list[SamplingParams]:
    return [SamplingParams(temperature=1.0, seed=1000 + i, max_tokens=max_tokens, structured=spec, **kw)
            for i in range(N)]


def complete_texts(llm: LLM, prompt, params: list[SamplingParams]) -> list[str]:
    outs = llm.generate([prompt] * len(params), params)
    reasons = [o.outputs[0].finish_reason for o in outs]
    assert reasons == ["stop"] * len(params), reasons
    assert len(llm.engine.structured) == 0  # every matcher was freed
    return [o.outputs[0].text for o in outs]


SCHEMAS = {
    "nested-objects": {"type": "object", "properties": {
        "outer": {"type": "object", "properties": {
            "inner": {"type": "object", "properties": {"v": {"type": "boolean"}}, "required": ["v"]}},
            "required": ["inner"]}}, "required": ["outer"]},
    "arrays": {"type": "object", "properties": {
        "xs": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1,
               "maxItems": 4},
        "pairs": {"type": "array", "items": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
                  "maxItems": 2}}, "required": ["xs", "pairs"]},
    "enums": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "size": {"type": "string", "enum": ["S", "M", "L"]},
        "level": {"enum": [1, 2, 3, None]}}, "required": ["color", "size", "level"]},
    "integer-bounds": {"type": "object", "properties": {
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "delta": {"type": "integer", "minimum": -5, "maximum": 5},
        "big": {"type": "integer", "exclusiveMinimum": 1000, "maximum": 1100}}, "required": ["age", "delta", "big"]},
    "required-optional": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99}, "name": {"type": "string", "maxLength": 6},
        "nick": {"type": "string", "maxLength": 3}, "ok": {"type": "boolean"}}, "required": ["id", "name"]},
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_50_of_50(llm, name):
    schema = SCHEMAS[name]
    values = [json.loads(t) for t in complete_texts(llm, PROMPT, sample(StructuredSpec.json_schema(schema), 160))]
    for value in values:
        jsonschema.validate(value, schema)
    if name == "required-optional":  # optional fields really are optional: both ways occur
        for key in ("nick", "ok"):
            assert any(key in v for v in values) and any(key not in v for v in values)


def test_unconstrained_output_is_noise(llm):
    """The same sampling without a constraint: the model does not write JSON by itself."""
    outs = llm.generate([PROMPT] * N, [SamplingParams(temperature=1.0, seed=1000 + i, max_tokens=40)
                                       for i in range(N)])
    parsed = 0
    for out in outs:
        try:
            json.loads(out.outputs[0].text)
            parsed += 1
        except ValueError:
            pass
    assert parsed < 3


def test_regex_choice_and_grammar_50_of_50(llm):
    pattern = r"[A-Z]{3}-[0-9]{2,4}"
    for text in complete_texts(llm, PROMPT, sample(StructuredSpec.regex(pattern), 16)):
        assert re.fullmatch(pattern, text), text
    options = ["alpha", "beta", "gamma delta"]
    texts = complete_texts(llm, PROMPT, sample(StructuredSpec.choice(options), 16))
    assert set(texts) <= set(options) and len(set(texts)) > 1
    ebnf = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x"'
    for text in complete_texts(llm, PROMPT, sample(StructuredSpec.grammar(ebnf), 60)):
        assert re.fullmatch(r"\((?:[0-9]|x)(?:,(?:[0-9]|x))*\)", text), text


def test_json_object_finishes_as_an_object_or_says_length(llm):
    """Any object: free-text keys may run long, so some hit max_tokens, and say so."""
    outs = llm.generate([PROMPT] * N, sample(StructuredSpec.json_object(), 24))
    stopped = [o.outputs[0] for o in outs if o.outputs[0].finish_reason == "stop"]
    assert 10 <= len(stopped) < N
    for c in stopped:
        assert isinstance(json.loads(c.text), dict)
    for o in outs:
        c = o.outputs[0]
        if c.finish_reason != "stop":
            assert c.finish_reason == "length" and len(c.token_ids) == 24 and c.text.startswith("{")


def test_n_samples_and_preemption_keep_every_output_valid(tmp_path_factory):
    """A KV pool too small for the batch: sequences are preempted and recomputed, matchers and all."""
    path = tmp_path_factory.mktemp("structured_preempt")
    save_tiny_model(path)
    llm = LLM(str(path), registry=qwen_registry(), dtype="float32", max_model_len=256, max_num_seqs=16,
              num_kv_blocks=12, block_size=16)
    schema = SCHEMAS["arrays"]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=80, n=2, structured=StructuredSpec.json_schema(schema))
              for i in range(12)]
    outs = llm.generate([PROMPT] * 12, params)
    assert llm.engine.scheduler.num_preemptions > 0
    for out in outs:
        for c in out.outputs:
            assert c.finish_reason == "stop"
            jsonschema.validate(json.loads(c.text), schema)
    assert len(llm.engine.structured) == 0


def test_length_is_reported_when_the_grammar_cannot_finish(llm):
    spec = StructuredSpec.json_schema(SCHEMAS["nested-objects"])
    out = llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=3, max_tokens=5, structured=spec))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert '{"outer": {"inner": {"v": '.startswith(out.text)  # a prefix of the only possible start
    assert len(llm.engine.structured) == 0


def test_invalid_constraints_are_refused_holding_nothing(llm):
    engine = llm.engine
    bad = [StructuredSpec.json_schema({"type": "integer", "minimum": 5, "maximum": 1}),
           StructuredSpec.json_schema({"type": "strnig"}), StructuredSpec.regex("(ab"),
           StructuredSpec.grammar("root ::= undefined_rule"),
           StructuredSpec.json_schema({"type": "string", "pattern": "^a+$", "maxLength": 3})]
    messages = []
    for spec in bad:
        with pytest.raises(InvalidRequestError) as info:
            engine.add_request("bad", PROMPT, SamplingParams(structured=spec))
        messages.append(str(info.value))
    assert "minimum greater than maximum" in messages[0] and 'Unsupported type "strnig"' in messages[1]
    assert "parenthesis" in messages[2] and "undefined_rule" in messages[3] and "pattern" in messages[4]
    assert not any("/project/" in m or ".cc:" in m for m in messages)  # no xgrammar source locations
    assert not engine.requests and not engine.scheduler.waiting and len(engine.structured) == 0
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured=StructuredSpec.json_object())


def test_abort_frees_the_matcher(llm):
    engine = llm.engine
    engine.add_request("to-abort", PROMPT, SamplingParams(temperature=1.0, max_tokens=50,
                                                           structured=StructuredSpec.json_object()))
    engine.step()
    assert len(engine.structured) == 1
    engine.abort_request("to-abort")
    assert len(engine.structured) == 0 and not engine.has_unfinished_requests()


def test_the_compiled_grammar_is_shared_by_equal_constraints(llm):
    compiler = llm.engine.structured.compiler
    schema = {"type": "object", "properties": {"q": {"type": "boolean"}}, "required": ["q"]}
    before = compiler.num_compiled
    complete_texts(llm, PROMPT, sample(StructuredSpec.json_schema(schema), 20))
    complete_texts(llm, PROMPT, sample(StructuredSpec.json_schema(json.loads(json.dumps(schema))), 20))
    assert compiler.num_compiled == before + 1


# ---- forced tool calls

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
        "type": "object", "properties": {
            "city": {"type": "string", "enum": ["Paris", "Berlin", "Tokyo"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
            "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "add", "description": "Add numbers", "parameters": {
        "type": "object", "properties": {
            "xs": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 3},
            "label": {"type": "string", "maxLength": 4}},
        "required": ["xs", "label"]}}},
]
TOOL_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ALL = tuple(TOOL_SCHEMAS)


def chat_prompt(llm: LLM) -> list[int]:
    """A short chat prompt: the tool list is left out (760 prompt tokens x 50 would only slow the test down;
    the random model does not read it anyway)."""
    text = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "What is the weather in Paris?"}],
                                                   enable_thinking=False)
    assert not Qwen3ReasoningParser.prompt_opens_reasoning(text)
    return llm.get_tokenizer().encode(text)


@pytest.mark.parametrize("constraint", [
    ToolCallConstraint(True, ALL, frozenset(ALL), parallel=False),
    ToolCallConstraint(True, ALL, frozenset(ALL), parallel=True),
    ToolCallConstraint(True, ("add",), frozenset({"add"}), parallel=False),
], ids=["single", "parallel", "named"])
def test_forced_tool_calls_50_of_50(llm, constraint):
    spec = Qwen3CoderToolParser.tool_call_grammar(TOOLS, constraint)
    counts = []
    budget = 900 if constraint.parallel else 300  # a call is about 60 tokens; parallel ones repeat at random
    for text in complete_texts(llm, {"prompt_token_ids": chat_prompt(llm)}, sample(spec, budget)):
        parsed = ParserPipeline(Qwen3ReasoningParser(thinking_open=False), Qwen3CoderToolParser(TOOLS)
                                ).parse_complete(text)
        message = chat_message(parsed)  # OpenAI
        assert message["content"] is None and message["tool_calls"], text
        counts.append(len(message["tool_calls"]))
        for call in message["tool_calls"]:
            name = call["function"]["name"]
            assert name in constraint.allowed
            jsonschema.validate(json.loads(call["function"]["arguments"]), TOOL_SCHEMAS[name])
        blocks = content_blocks(parsed)  # Anthropic
        assert [b["type"] for b in blocks] == ["tool_use"] * len(message["tool_calls"])
        for block in blocks:
            jsonschema.validate(block["input"], TOOL_SCHEMAS[block["name"]])
    if constraint.parallel:
        assert max(counts) > 1
    else:
        assert set(counts) == {1}
