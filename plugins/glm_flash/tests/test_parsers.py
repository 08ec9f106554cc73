"""glm47 tool calls and glm45 reasoning: the template's own call format round-trips, typed arguments, content
around calls, GLM-4.5's newline layout, malformed and cut-off calls, any chunking; the forced-call grammar's
outputs read back as valid calls."""
from __future__ import annotations

import json

import jsonschema
import pytest

from armillary.chat_template import render_chat_template
from armillary.parsers.base import ParserPipeline
from armillary.parsers.conformance import check_chunking_invariance, counting_ids
from armillary.registry import PluginRegistry
from armillary.structured.spec import ToolCallConstraint
from armillary_glm_flash import hooks
from armillary_glm_flash.parsers.glm47 import Glm47ToolParser
from armillary_glm_flash.parsers.reasoning import Glm45ReasoningParser
from tests.test_structured_grammar import finished, walker  # noqa: F401 (walker is a fixture)

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "required": ["city"],
                                                                             "properties": {
        "city": {"type": "string"}, "days": {"type": "integer", "minimum": 0, "maximum": 99},
        "celsius": {"type": "boolean"}}}}},
    {"type": "function", "function": {"name": "configure", "parameters": {"type": "object", "properties": {
        "ratio": {"type": "number", "minimum": 0, "maximum": 10}, "options": {"type": "object"},
        "tags": {"type": "array"},
        "note": {"type": ["string", "null"]}, "text": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "list_files"}},
    {"type": "function", "function": {"name": "set_mode", "parameters": {"type": "object", "required": ["mode", "code"],
                                                                          "properties": {
        "mode": {"enum": ["fast", "null", "slow"]}, "code": {"type": "string", "pattern": "[A-Z]{2}[0-9]"},
        "level": {"type": ["integer", "null"], "minimum": 0, "maximum": 5}}}}},
]
MARKUP = Glm47ToolParser.markup_strings + Glm45ReasoningParser.markup_strings

# GLM-4.7-Flash's chat template, its assistant turn verbatim (the tool-call lines as published)
TEMPLATE = """{%- for m in messages -%}
{%- if m.role == 'user' -%}<|user|>{{ m.content }}
{%- elif m.role == 'assistant' -%}<|assistant|>
{%- if m.reasoning_content is string -%}{{ '<think>' + m.reasoning_content + '</think>' }}
{%- else -%}{{ '</think>' }}{%- endif -%}
{%- if m.content -%}{{ m.content.strip() }}{%- endif -%}
{% if m.tool_calls %}
{% for tc in m.tool_calls %}
{%- if tc.function %}
    {%- set tc = tc.function %}
{%- endif %}
{{- '<tool_call>' + tc.name -}}
{% set _args = tc.arguments %}{% for k, v in _args.items() %}<arg_key>{{ k }}</arg_key><arg_value>{{ v | tojson(ensure_ascii=False) if v is not string else v }}</arg_value>{% endfor %}</tool_call>{% endfor %}
{% endif %}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|assistant|><think>{%- endif -%}"""


def pipeline(thinking_open: bool = False) -> ParserPipeline:
    return ParserPipeline(Glm45ReasoningParser(thinking_open), Glm47ToolParser(TOOLS, counting_ids()))


def call(name: str, **args: str) -> str:
    return f"<tool_call>{name}" + "".join(f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>"
                                          for k, v in args.items()) + "</tool_call>"


CASES = {
    "content only": ("Hello! a < b, <tool_ is not a tag, nor <arg_key>x</arg_key>.",
                     "Hello! a < b, <tool_ is not a tag, nor <arg_key>x</arg_key>.", []),
    "content and one call": ("Let me check." + call("get_weather", city="Paris", days="3"),
                             "Let me check.", [("get_weather", {"city": "Paris", "days": 3})]),
    "two calls back to back": (call("get_weather", city="Paris") + call("get_weather", city="Oslo", celsius="false"),
                               "", [("get_weather", {"city": "Paris"}),
                                    ("get_weather", {"city": "Oslo", "celsius": False})]),
    "typed arguments": (call("configure", ratio="0.75", options='{"depth": 2}', tags='["x", "y"]', note="null",
                             text='say "hi"\n\tnull <b>'),
                        "", [("configure", {"ratio": 0.75, "options": {"depth": 2}, "tags": ["x", "y"], "note": None,
                                            "text": 'say "hi"\n\tnull <b>'})]),
    "no arguments": (call("list_files") + "\n", "", [("list_files", {})]),
    "GLM-4.5 newline layout": ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Bern</arg_value>\n"
                               "</tool_call>\nDone.", "Done.", [("get_weather", {"city": "Bern"})]),
    "unknown tool, untyped values": (call("other", n="5", s="text", j='{"a": [1]}'),
                                     "", [("other", {"n": 5, "s": "text", "j": {"a": [1]}})]),
    "malformed header is text": ("<tool_call><arg_key>x</arg_key></tool_call> ok",
                                 "<tool_call><arg_key>x</arg_key></tool_call> ok", []),
    "cut-off value keeps its text": ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Lis",
                                     "", [("get_weather", {"city": "Lis"})]),
    "cut-off key is dropped": ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value><arg_key>da",
                               "", [("get_weather", {"city": "Rome"})]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_calls_over_every_chunking(name):
    text, content, calls = CASES[name]
    message = check_chunking_invariance(pipeline, text, forbidden_in_text=() if not calls else ("<arg_value>",))
    assert message.content == content
    assert [(c.name, json.loads(c.arguments)) for c in message.tool_calls] == calls


def test_reasoning_then_calls_over_every_chunking():
    text = "Need the weather.\n</think>\nChecking." + call("get_weather", city="Kyiv")
    message = check_chunking_invariance(lambda: pipeline(thinking_open=True), text, MARKUP)
    assert message.reasoning == "Need the weather." and message.content == "Checking."
    assert json.loads(message.tool_calls[0].arguments) == {"city": "Kyiv"}
    # thinking off: the prompt closed the block, everything is content
    assert not Glm45ReasoningParser.prompt_opens_reasoning("<|user|>hi<|assistant|></think>")
    assert Glm45ReasoningParser.prompt_opens_reasoning("<|user|>hi<|assistant|><think>")


def test_template_calls_round_trip():
    """Calls rendered by the chat template's own lines parse back to the same calls, whatever their types."""
    calls = [{"name": "configure", "arguments": {"ratio": 1.5, "options": {"k": [1, {"z": None}], "ü": "ß"},
                                                 "tags": ["a", "b"], "note": None,
                                                 "text": 'multi\nline "quoted" <tag> 100%'}},
             {"name": "get_weather", "arguments": {"city": "São Paulo", "days": 10, "celsius": True}},
             {"name": "list_files", "arguments": {}}]
    messages = [{"role": "user", "content": "go"},
                {"role": "assistant", "reasoning_content": "plan", "content": "Calling.",
                 "tool_calls": [{"type": "function", "function": c} for c in calls]}]
    rendered = render_chat_template(TEMPLATE, messages, tools=TOOLS, add_generation_prompt=False)
    output = rendered.split("<|assistant|>", 1)[1]
    assert "<tool_call>configure<arg_key>ratio</arg_key><arg_value>1.5</arg_value>" in output
    message = check_chunking_invariance(pipeline, output, MARKUP)
    assert message.reasoning == "plan" and message.content.strip() == "Calling."
    assert [(c.name, json.loads(c.arguments)) for c in message.tool_calls] == [(c["name"], c["arguments"])
                                                                             for c in calls]


SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object", "properties": {}})
           for t in TOOLS}
NAMES = tuple(SCHEMAS)
CONSTRAINTS = {
    "required-parallel": ToolCallConstraint(True, NAMES, frozenset(NAMES), parallel=True),
    "named": ToolCallConstraint(True, ("set_mode",), frozenset({"set_mode"}), parallel=False),
    "unchecked": ToolCallConstraint(True, ("configure",), frozenset(), parallel=False),
}


@pytest.mark.parametrize("constraint", list(CONSTRAINTS))
def test_forced_grammar_reads_back_valid_calls(walker, constraint):
    constraint = CONSTRAINTS[constraint]
    spec = Glm47ToolParser.tool_call_grammar(TOOLS, constraint)
    counts = []
    for text in finished(walker.sample(spec, 60, 500), at_least=25):  # raw strings end only on </arg_value>
        message = ParserPipeline(None, Glm47ToolParser(TOOLS)).parse_complete(text)
        assert message.content.strip() == "" and message.tool_calls, text
        counts.append(len(message.tool_calls))
        for parsed in message.tool_calls:
            assert parsed.name in constraint.allowed
            if parsed.name in constraint.schema_checked:
                jsonschema.validate(json.loads(parsed.arguments), SCHEMAS[parsed.name])
    assert max(counts) > 1 if constraint.parallel else set(counts) == {1}


def test_plugin_registers_both_parsers_as_defaults():
    registry = PluginRegistry()
    registry.register(hooks, "glm_flash")
    assert registry.parsers.get("glm47").load() is Glm47ToolParser
    assert registry.parsers.get("glm45").load() is Glm45ReasoningParser
    spec = registry.architectures.for_hf_architecture("Glm4MoeLiteForCausalLM")
    assert (spec.default_tool_parser, spec.default_reasoning_parser) == ("glm47", "glm45")
