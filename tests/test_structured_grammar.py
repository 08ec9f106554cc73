"""Grammars alone, no model: outputs drawn uniformly from the allowed tokens must parse and validate.

``GrammarWalker`` runs the engine's own grammar path (matchers, batch mask fill, UTF-8 guard,
mask application, advance) with all-zero logits, so every token a grammar allows is equally
likely: a harsher sampler than any model. Each case draws hundreds of outputs.
"""
from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch
import xgrammar as xgr

from armillary.parsers.base import ParserPipeline
from armillary.sampling_params import SamplingParams
from armillary.sequence import Sequence
from armillary.structured.outputs import StructuredOutputs
from armillary.structured.spec import StructuredSpec, ToolCallConstraint
from armillary.tokenizer import Tokenizer
from armillary.parsers.qwen3_coder import Qwen3CoderToolParser
from armillary.parsers.qwen3_coder_grammar import (
    PARAMETER_END,
    _bounded_text_ebnf,
    _unbounded_text_ebnf,
)
from tests.fixtures.tiny_tokenizer import make_qwen_tokenizer

VOCAB = 300
EOS = (293, 291)  # <|im_end|>, <|endoftext|> in the tiny tokenizer


class GrammarWalker:
    """Samples whole outputs of a grammar: uniform over the allowed tokens, through ``StructuredOutputs``."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.outputs = StructuredOutputs(tokenizer, VOCAB, EOS)

    def sample(self, spec: StructuredSpec, n: int, max_tokens: int, seed: int = 0) -> list[tuple[str, bool]]:
        """n outputs as (text, whether the grammar finished them within max_tokens)."""
        compiled = self.outputs.compile(spec)
        seqs = [Sequence(f"walk-{i}", 0, [0], SamplingParams(max_tokens=max_tokens)) for i in range(n)]
        for seq in seqs:
            self.outputs.attach(seq, compiled)
        generator = torch.Generator().manual_seed(seed)
        active, done = list(seqs), set()
        for _ in range(max_tokens):
            if not active:
                break
            mask = self.outputs.fill(active)
            logits = mask.apply(torch.zeros(len(active), VOCAB))  # [N, V]: 0 allowed, -inf not
            noise = torch.empty(len(active), VOCAB).exponential_(generator=generator)
            tokens = (logits - noise.log()).argmax(dim=-1).tolist()
            still = []
            for seq, token in zip(active, tokens):
                seq.token_ids.append(token)
                if self.outputs.advance(seq, token):
                    done.add(seq.seq_id)
                    self.outputs.release(seq)
                else:
                    still.append(seq)
            active = still
        for seq in active:
            self.outputs.release(seq)
        assert len(self.outputs) == 0
        return [(self.tokenizer.decode([t for t in s.output_token_ids if t not in EOS]), s.seq_id in done)
                for s in seqs]


@pytest.fixture(scope="module")
def walker(tmp_path_factory) -> GrammarWalker:
    path = tmp_path_factory.mktemp("walk_tokenizer")
    make_qwen_tokenizer(path, vocab_size=VOCAB)
    return GrammarWalker(Tokenizer.from_pretrained(path))


def finished(outputs: list[tuple[str, bool]], at_least: int) -> list[str]:
    texts = [text for text, done in outputs if done]
    assert len(texts) >= at_least, f"only {len(texts)} of {len(outputs)} outputs completed"
    return texts


# ---- JSON

JSON_CASES = {
    "lengths": {"type": "object", "properties": {
        "a": {"type": "string", "maxLength": 5}, "b": {"type": "string", "minLength": 2, "maxLength": 4},
        "c": {"type": "array", "items": {"type": "string", "maxLength": 2}, "minItems": 1, "maxItems": 2}},
        "required": ["a", "b", "c"]},
    "numbers": {"type": "object", "properties": {
        "i": {"type": "integer", "minimum": -20, "maximum": 20}, "n": {"type": "number", "minimum": 0, "maximum": 1},
        "e": {"enum": [1, "two", None, True]}, "z": {"type": ["integer", "null"]}},
        "required": ["i", "n", "e"]},
    "refs": {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0,
                                                                     "maximum": 3}}, "required": ["x"]}},
             "type": "object", "properties": {"p": {"$ref": "#/$defs/pt"},
                                              "q": {"anyOf": [{"$ref": "#/$defs/pt"}, {"type": "boolean"}]}},
             "required": ["p", "q"]},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{2,3}$"},
                                                 "free": {"type": "string", "pattern": "^.{0,3}$"}},
                "required": ["code", "free"]},
}


@pytest.mark.parametrize("name", sorted(JSON_CASES))
def test_json_schema_outputs_validate(walker, name):
    schema = JSON_CASES[name]
    for text in finished(walker.sample(StructuredSpec.json_schema(schema), 200, 120), at_least=190):
        jsonschema.validate(json.loads(text), schema)


def test_choice_and_regex_outputs_match(walker):
    options = ["yes", "no", "maybe later", 'a "quoted" one']
    assert set(finished(walker.sample(StructuredSpec.choice(options), 100, 20), 100)) <= set(options)
    pattern = r"[a-c]{1,3}@[0-9]{2}\.(com|org)"
    for text in finished(walker.sample(StructuredSpec.regex(pattern), 100, 30), 100):
        assert re.fullmatch(pattern, text), text


def test_after_reasoning_the_constraint_starts_at_the_end_tag(walker):
    schema = {"type": "object", "properties": {"k": {"enum": ["x", "y"]}}, "required": ["k"]}
    spec = StructuredSpec.json_schema(schema).after_reasoning("</think>")
    texts = finished(walker.sample(spec, 100, 400), at_least=50)  # the end tag is 1 token in 300
    for text in texts:
        reasoning, end, reply = text.partition("</think>")
        assert end, text
        assert json.loads(reply) in ({"k": "x"}, {"k": "y"})
    assert any(text.index("</think>") > 0 for text in texts)  # the reasoning really ran free


# ---- qwen3_coder raw string values

def _admits(walker: GrammarWalker, ebnf: str, text: str) -> bool:
    matcher = xgr.GrammarMatcher(walker.outputs.compile(StructuredSpec.grammar(ebnf)))
    return matcher.accept_string(text) and matcher.is_completed()


def _fragments(rng: random.Random, n: int) -> str:
    pieces = ["<", "/", "</param", "</parameter", PARAMETER_END, "null", "nul", "n", "x", ">", "é", "\n"]
    return "".join(rng.choice(pieces) for _ in range(n))


@pytest.mark.parametrize("min_len,exclude_null", [(0, True), (0, False), (2, True), (6, True)])
def test_unbounded_raw_text_is_exactly_the_texts_without_the_end_tag(walker, min_len, exclude_null):
    ebnf = _unbounded_text_ebnf(min_len, exclude_null)
    rng = random.Random(min_len)
    for text in ["", "null", "nul", "nulll", "<", "</parameter", PARAMETER_END, "a</parameter>b", "<</parameter>"] \
            + [_fragments(rng, rng.randint(0, 6)) for _ in range(300)]:
        expected = PARAMETER_END not in text and len(text) >= min_len and not (exclude_null and text == "null")
        assert _admits(walker, ebnf, text) == expected, (text, min_len, exclude_null)


@pytest.mark.parametrize("low,high", [(0, 4), (2, 6), (4, 4), (0, 20), (5, 30)])
def test_bounded_raw_text_respects_lengths_and_null(walker, low, high):
    ebnf = _bounded_text_ebnf(low, high, exclude_null=True)
    rng = random.Random(high)
    for text in ["", "null", "nulx", "xnul", "abcd", "<ab", "<" * high] + [_fragments(rng, rng.randint(0, 5))
                                                                       for _ in range(200)]:
        in_class = "<" not in text or high < len(PARAMETER_END)
        expected = low <= len(text) <= high and text != "null" and in_class
        assert _admits(walker, ebnf, text) == expected, (text, low, high)


# ---- qwen3_coder tool calls

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 10},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "opts": {"type": "object", "properties": {"hourly": {"type": "boolean"}}, "required": ["hourly"]}},
        "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {
        "key": {"type": "string", "minLength": 3, "maxLength": 5},
        "count": {"type": ["integer", "null"]},
        "word": {"type": "string", "maxLength": 4},
        "ids": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3}},
        "required": ["key", "count", "word"]}}},
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
NAMES = tuple(SCHEMAS)


def parse_calls(text: str) -> tuple[str, list]:
    message = ParserPipeline(None, Qwen3CoderToolParser(TOOLS)).parse_complete(text)
    return message.content, message.tool_calls


@pytest.mark.parametrize("constraint", [
    ToolCallConstraint(True, NAMES, frozenset(NAMES), parallel=True),
    ToolCallConstraint(True, NAMES, frozenset(NAMES), parallel=False),
    ToolCallConstraint(True, ("lookup",), frozenset({"lookup"}), parallel=False),
], ids=["required-parallel", "required-single", "named"])
def test_forced_calls_parse_and_validate(walker, constraint):
    spec = Qwen3CoderToolParser.tool_call_grammar(TOOLS, constraint)
    counts = []
    for text in finished(walker.sample(spec, 200, 600), at_least=190):
        content, calls = parse_calls(text)
        assert content.strip() == "" and calls, text
        counts.append(len(calls))
        for call in calls:
            assert call.name in constraint.allowed
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    if constraint.parallel:
        assert max(counts) > 1
    else:
        assert set(counts) == {1}


def test_auto_strict_calls_are_constrained_once_opened(walker):
    constraint = ToolCallConstraint(False, NAMES, frozenset({"lookup"}), parallel=True)
    spec = Qwen3CoderToolParser.tool_call_grammar(TOOLS, constraint)
    calls_seen = 0
    for text, _ in walker.sample(spec, 200, 150):
        end = text.rfind("</tool_call>")
        if end < 0:
            continue
        _, calls = parse_calls(text[:end + len("</tool_call>")])  # up to the last complete call
        for call in calls:
            calls_seen += 1
            assert call.name in NAMES
            if call.name == "lookup":
                jsonschema.validate(json.loads(call.arguments), SCHEMAS["lookup"])
    assert calls_seen > 5
