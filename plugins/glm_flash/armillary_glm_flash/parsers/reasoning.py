"""GLM-4.5 / 4.6 / 4.7 reasoning parser (``--reasoning-parser glm45``).

The template's generation prompt ends with ``<|assistant|><think>`` when thinking is on (the
output starts inside reasoning and closes it with ``</think>``) and with
``<|assistant|></think>`` when it is off (the output is content); the generic ``<think>``
state machine covers both through ``prompt_opens_reasoning``.
"""
from __future__ import annotations

from typing import ClassVar

from armillary.parsers.think import ThinkReasoningParser


class Glm45ReasoningParser(ThinkReasoningParser):
    markup_strings: ClassVar[tuple[str, ...]] = ("<think>", "</think>")
