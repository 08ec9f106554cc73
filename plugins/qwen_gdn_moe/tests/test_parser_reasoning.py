"""Qwen3 reasoning parser: think blocks, template newlines, implicit end at a tool call, any chunking."""
from __future__ import annotations

import pytest

from armillary.parsers.base import ParsedMessage, ParserPipeline
from armillary.parsers.conformance import check_chunking_invariance, run_chunks
from armillary.parsers.events import ReasoningDelta, TextDelta
from armillary.registry import PluginRegistry

from armillary_qwen_gdn_moe import hooks
from armillary_qwen_gdn_moe.parsers.reasoning import Qwen3ReasoningParser

MARKUP = ("<think>", "</think>")
CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"


def reasoning_only(thinking_open: bool):
    return lambda: ParserPipeline(Qwen3ReasoningParser(thinking_open), None)


@pytest.mark.parametrize("thinking_open, text, reasoning, content", [
    # Qwen3.5 / 3.6 with enable_thinking: the prompt opened the block
    (True, "The user wants a sum.\nTwo plus two is four.", "The user wants a sum.\nTwo plus two is four.", ""),
    (True, "The user wants a sum.\n</think>\n\nThe answer is 4.", "The user wants a sum.", "The answer is 4."),
    (True, "Compare: a < b, and <thinking is not a tag.\n</think>\n\nSo a < b.",
     "Compare: a < b, and <thinking is not a tag.", "So a < b."),
    (True, "Überlegung: 東京 🌸 \"quoted\"\n</think>\n\n答案是 4。", "Überlegung: 東京 🌸 \"quoted\"", "答案是 4。"),
    (True, "</think>\n\nNo reasoning at all.", None, "No reasoning at all."),
    (True, "<think>\nThe model reopened it.\n</think>\n\nFine.", "The model reopened it.", "Fine."),
    # Qwen3.5 opening a tool call straight from reasoning: the call goes on as content
    (True, "I need the weather.\n\n" + CALL, "I need the weather.", CALL),
    # a bare <tool_call> mentioned in reasoning is reasoning
    (True, "Maybe a <tool_call> is needed.\n</think>\n\nNo.", "Maybe a <tool_call> is needed.", "No."),
    (True, "Ends on <tool_call>\n", "Ends on <tool_call>\n", ""),
    # older templates: the model writes <think> itself
    (False, "<think>\nLet me think.\n</think>\n\nHello!", "Let me think.", "Hello!"),
    # enable_thinking=False: the prompt holds an empty think block, the output is content
    (False, "Hello! a < b <thinking> </think>", None, "Hello! a < b <thinking> </think>"),
    (False, "", None, ""),
])
def test_qwen3_reasoning_all_chunkings(thinking_open, text, reasoning, content):
    forbidden = () if "</think>" in content else MARKUP
    message = check_chunking_invariance(reasoning_only(thinking_open), text, forbidden_in_text=forbidden)
    assert message == ParsedMessage(content=content, reasoning=reasoning, tool_calls=[])


def test_reasoning_streams_before_the_block_closes():
    text = "Step one. Step two. Step three.\n</think>\n\nDone."
    events = run_chunks(reasoning_only(True)(), [text[i:i + 3] for i in range(0, len(text), 3)])
    first_text = next(i for i, e in enumerate(events) if isinstance(e, TextDelta))
    reasoning_events = [e for e in events[:first_text] if isinstance(e, ReasoningDelta)]
    assert len(reasoning_events) >= 8  # streamed piece by piece, not held to the end
    assert all(isinstance(e, TextDelta) for e in events[first_text:])


def test_partial_implicit_end_is_held_until_decided():
    parser = Qwen3ReasoningParser(thinking_open=True)
    assert parser.feed("Call it.\n<tool_") == [ReasoningDelta("Call it.")]
    assert parser.feed("call>\n<func") == []
    assert parser.feed("tion=f>") == [TextDelta("<tool_call>\n<function=f>")]


def test_prompt_opens_reasoning_on_qwen_templates():
    assert Qwen3ReasoningParser.prompt_opens_reasoning("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert not Qwen3ReasoningParser.prompt_opens_reasoning(
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_registered_under_qwen3():
    registry = PluginRegistry()
    registry.register(hooks, "qwen_gdn_moe")
    spec = registry.parsers.get("qwen3")
    assert spec.kind == "reasoning"
    assert spec.load() is Qwen3ReasoningParser
    assert "</think>" in Qwen3ReasoningParser.markup_strings
