"""Nemotron-3 Nano output parsing: the ``nano_v3`` reasoning parser over the template's two prompt
endings (``<think>\\n`` open, ``<think></think>`` closed), one newline after ``</think>``, a tool call
straight from reasoning, any chunking; and the template's qwen3_coder tool calls through the full
pipeline with the tool parser the architecture names by default."""
from __future__ import annotations

import pytest

from armillary.parsers.base import ParsedMessage, ParserPipeline
from armillary.parsers.conformance import check_chunking_invariance, counting_ids
from armillary.parsers.events import ReasoningDelta, TextDelta
from armillary.registry import PluginRegistry
from armillary_nemotron import hooks
from armillary_nemotron.parsers.reasoning import NanoV3ReasoningParser

MARKUP = ("<think>", "</think>")
CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]


def reasoning_only(thinking_open: bool):
    return lambda: ParserPipeline(NanoV3ReasoningParser(thinking_open), None)


@pytest.mark.parametrize("thinking_open, text, reasoning, content", [
    (True, "The user asks for a sum.\nTwo plus two is four.\n</think>\nThe answer is 4.",
     "The user asks for a sum.\nTwo plus two is four.", "The answer is 4."),
    (True, "Unfinished thought a < b", "Unfinished thought a < b", ""),
    (True, "</think>\nNo reasoning.", None, "No reasoning."),
    (True, "<think>\nReopened.\n</think>\nFine.", "Reopened.", "Fine."),
    (True, "Überlegung 東京 🌸\n</think>\n答案 4。", "Überlegung 東京 🌸", "答案 4。"),
    (True, "I need the weather.\n" + CALL, "I need the weather.", CALL),
    (True, "Maybe a <tool_call> later.\n</think>\nNo.", "Maybe a <tool_call> later.", "No."),
    # enable_thinking=False: the prompt ends with <think></think>, the output is content
    (False, "Hello! a < b", None, "Hello! a < b"),
    (False, "", None, ""),
])
def test_nano_v3_reasoning_all_chunkings(thinking_open, text, reasoning, content):
    forbidden = () if "</think>" in content else MARKUP
    message = check_chunking_invariance(reasoning_only(thinking_open), text, forbidden_in_text=forbidden)
    assert message == ParsedMessage(content=content, reasoning=reasoning, tool_calls=[])


def test_prompt_endings_of_the_nano_template():
    on = "<|im_start|>system\n<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    off = "<|im_start|>system\n<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think></think>"
    assert NanoV3ReasoningParser.prompt_opens_reasoning(on)
    assert not NanoV3ReasoningParser.prompt_opens_reasoning(off)


def test_reasoning_streams_before_the_block_closes():
    parser = NanoV3ReasoningParser(thinking_open=True)
    assert parser.feed("Step one. ") == [ReasoningDelta("Step one. ")]
    assert parser.feed("Call.\n<tool_") == [ReasoningDelta("Call.")]
    assert parser.feed("call>\n<function=f>") == [TextDelta("<tool_call>\n<function=f>")]


def test_registered_as_the_architecture_default():
    registry = PluginRegistry()
    registry.register(hooks, "nemotron")
    spec = registry.parsers.get("nano_v3")
    assert spec.kind == "reasoning" and spec.load() is NanoV3ReasoningParser
    arch = registry.resolve_architecture(["NemotronHForCausalLM"])
    assert arch.default_reasoning_parser == "nano_v3" and arch.default_tool_parser == "qwen3_coder"


def test_tool_call_from_reasoning_through_the_pipeline():
    """Reasoning, then a qwen3_coder call, parsed by core's qwen3_coder parser (no other plugin needed)."""
    tool_cls = PluginRegistry().parsers.get("qwen3_coder").load()

    def make():
        return ParserPipeline(NanoV3ReasoningParser(True), tool_cls(TOOLS, id_generator=counting_ids()))

    message = check_chunking_invariance(make, "Check the forecast.\n</think>\n" + CALL, forbidden_in_text=MARKUP)
    assert message.reasoning == "Check the forecast." and message.content == ""
    (call,) = message.tool_calls
    assert call.name == "get_weather" and call.arguments == '{"city": "Paris", "days": 3}'
