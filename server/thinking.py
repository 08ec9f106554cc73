"""One reply's thinking: its reasoning budget and the sampling defaults of its mode (thinking on / off, tools).

Budget, the first that is given: ``chat_template_kwargs.thinking_budget`` (tokens); Anthropic's
``thinking.budget_tokens``; an effort (OpenAI ``reasoning_effort``, Responses
``reasoning.effort``, Anthropic ``output_config.effort``) through ``EFFORT_BUDGETS``; else the
server's ``--max-thinking-budget``, which also caps every request's budget. A budget applies only
when the prompt leaves a reasoning block open (thinking on); the engine then forces the
reasoning parser's end tag after that many reasoning tokens (``armillary.thinking_budget``).

Sampling defaults, for the knobs a request leaves unset: the checkpoint's generation_config.json,
overlaid (with ``--generation-config auto``) by the mode defaults the model's plugin declares
(``ArchSpec.sampling_defaults``: keys ``thinking`` / ``non_thinking``, optionally with a
``_tools`` suffix for replies offered tools).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from armillary.server.errors import bad_request, not_supported

# effort -> reasoning tokens; efforts beyond "high" (Anthropic's xhigh / max) leave only the server's cap
EFFORT_BUDGETS = {"minimal": 512, "low": 2048, "medium": 8192, "high": 24576}
BUDGET_KWARG = "thinking_budget"  # the chat_template_kwargs key (also passed on to the template)


@dataclass(slots=True)
class ReplyThinking:
    """What the sampling parameters of one reply get: defaults for unset knobs, and the thinking fields."""

    sampling_defaults: dict[str, Any]
    thinking_budget: int | None = None
    thinking_end: str | None = None

    def fields(self) -> dict[str, Any]:
        """``SamplingParams`` keyword arguments (``thinking_budget``, ``thinking_end``)."""
        if self.thinking_budget is None:
            return {}
        return {"thinking_budget": self.thinking_budget, "thinking_end": self.thinking_end}


def requested_budget(template_kwargs: dict[str, Any], effort: str | None = None,
                     budget_tokens: int | None = None) -> int | None:
    """The budget a request asks for (None: none); a bad ``thinking_budget`` is a 400."""
    if BUDGET_KWARG in template_kwargs and template_kwargs[BUDGET_KWARG] is not None:
        value = template_kwargs[BUDGET_KWARG]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise bad_request(f"chat_template_kwargs.{BUDGET_KWARG} must be a non-negative integer, got {value!r}",
                              param=f"chat_template_kwargs.{BUDGET_KWARG}")
        return value
    if budget_tokens is not None:
        return budget_tokens
    return EFFORT_BUDGETS.get(effort) if effort is not None else None


def reply_thinking(state: Any, prompt_text: str, tools: list[dict] | None, template_kwargs: dict[str, Any],
                   effort: str | None = None, budget_tokens: int | None = None) -> ReplyThinking:
    """The sampling defaults and thinking budget of a reply to ``prompt_text`` (the rendered prompt).

    An explicit ``thinking_budget`` on a server without a reasoning parser is a 400; an effort or
    Anthropic's budget there has no reasoning to limit (as vLLM, it changes nothing).
    """
    requested = requested_budget(template_kwargs, effort, budget_tokens)
    if template_kwargs.get(BUDGET_KWARG) is not None and state.parsers.reasoning_cls is None:
        raise not_supported("a thinking budget on a server without a reasoning parser (start it with "
                            "--reasoning-parser NAME)", param=f"chat_template_kwargs.{BUDGET_KWARG}")
    thinking = state.parsers.thinking_open(prompt_text)
    defaults = state.sampling_defaults(thinking, bool(tools))
    cap = state.max_thinking_budget
    budget = requested if cap is None else (cap if requested is None else min(requested, cap))
    if budget is None or not thinking:
        return ReplyThinking(defaults)  # thinking off: nothing to budget
    end_tag = getattr(state.parsers.reasoning_cls, "end_tag", None)
    if end_tag is None:
        raise not_supported(f"a thinking budget with the {state.parsers.reasoning_name} reasoning parser (it has no "
                            "end tag to force)", param=f"chat_template_kwargs.{BUDGET_KWARG}")
    return ReplyThinking(defaults, budget, end_tag)


def mode_defaults(modes: dict[str, dict[str, Any]], thinking: bool, tools: bool) -> dict[str, Any]:
    """The declared defaults of a mode: ``thinking`` / ``non_thinking``, the ``_tools`` entry first when tools."""
    mode = "thinking" if thinking else "non_thinking"
    if tools and f"{mode}_tools" in modes:
        return dict(modes[f"{mode}_tools"])
    return dict(modes.get(mode, {}))
