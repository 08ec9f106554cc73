"""Nemotron-3 Nano reasoning parser (``--reasoning-parser nano_v3``, vLLM's name for it).

The Nano chat template ends a thinking prompt with ``<think>\\n`` and a non-thinking one
(``enable_thinking=False``) with an empty ``<think></think>`` block, so the output starts inside
reasoning exactly when the prompt left a ``<think>`` open (``prompt_opens_reasoning``); the model
then writes only ``</think>``. A tool call (``<tool_call>`` then ``<function=``, the qwen3_coder
format the template renders) ends reasoning without a ``</think>`` and goes on as content.
"""
from __future__ import annotations

from typing import ClassVar

from armillary.parsers.think import ThinkReasoningParser


class NanoV3ReasoningParser(ThinkReasoningParser):
    implicit_end_tag: ClassVar[str | None] = "<tool_call>"
    implicit_end_confirm: ClassVar[str | None] = "<function="
    markup_strings: ClassVar[tuple[str, ...]] = ("<think>", "</think>", "<tool_call>")
