"""Qwen3 / Qwen3.5 / Qwen3.6 reasoning parser (``--reasoning-parser qwen3``)."""
from __future__ import annotations

from typing import ClassVar

from armillary.parsers.think import ThinkReasoningParser


class Qwen3ReasoningParser(ThinkReasoningParser):
    """``<think>…</think>`` as the generic parser does, plus Qwen3.5's habit of opening a tool call
    straight from reasoning: ``<tool_call>`` followed by ``<function=`` ends reasoning and goes on
    as content (for the tool parser); a bare ``<tool_call>`` mentioned in reasoning stays reasoning.

    With ``enable_thinking`` the template ends the prompt with ``<think>\\n`` (``thinking_open``);
    without it the prompt holds an empty ``<think>\\n\\n</think>\\n\\n`` block and the output is
    content. Older templates (up to the 2507 releases) let the model write ``<think>`` itself.
    """

    implicit_end_tag: ClassVar[str | None] = "<tool_call>"
    implicit_end_confirm: ClassVar[str | None] = "<function="
    markup_strings: ClassVar[tuple[str, ...]] = ("<think>", "</think>", "<tool_call>")
