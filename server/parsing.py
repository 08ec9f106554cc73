"""Which reasoning and tool-call parsers a server uses, and one parser pipeline per response choice."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from armillary.errors import InvalidRequestError, PluginError
from armillary.parsers.base import ParserPipeline, ReasoningParser, ToolParser
from armillary.server.errors import bad_request, not_supported
from armillary.server.sampling import RequestedStructure
from armillary.structured.spec import ToolCallConstraint

log = logging.getLogger("armillary.server")

DISABLED = "none"  # --tool-call-parser none / --reasoning-parser none


@dataclass(slots=True)
class ParserSetup:
    """The parser classes in use; ``keep_special_tokens``: a parser's markup is a special token, so
    detokenization must not skip special tokens or the parser would never see it."""

    reasoning_cls: type[ReasoningParser] | None = None
    tool_cls: type[ToolParser] | None = None
    reasoning_name: str | None = None
    tool_name: str | None = None
    keep_special_tokens: bool = False

    @classmethod
    def resolve(cls, registry: Any, arch: Any, tokenizer: Any, tool_parser: str | None,
                reasoning_parser: str | None) -> ParserSetup:
        """``tool_parser`` / ``reasoning_parser``: a registered name, ``"none"``, or None for the
        architecture's default. A named parser that cannot load is an error; a default one only warns."""
        reasoning_name, reasoning_cls = _load(registry, "reasoning", reasoning_parser,
                                              getattr(arch, "default_reasoning_parser", None))
        tool_name, tool_cls = _load(registry, "tool", tool_parser, getattr(arch, "default_tool_parser", None))
        setup = cls(reasoning_cls, tool_cls, reasoning_name, tool_name)
        setup.keep_special_tokens = _markup_is_special(tokenizer, setup.markup_strings())
        return setup

    def markup_strings(self) -> tuple[str, ...]:
        found: list[str] = []
        for parser_cls in (self.reasoning_cls, self.tool_cls):
            if parser_cls is not None:
                found.extend(s for s in parser_cls.markup_strings if s not in found)
        return tuple(found)

    def thinking_open(self, prompt: str) -> bool:
        return self.reasoning_cls is not None and bool(self.reasoning_cls.prompt_opens_reasoning(prompt))

    def pipeline(self, prompt: str, tools: list[dict] | None, parse_tools: bool) -> ParserPipeline:
        """A fresh pipeline for one choice. Without parsers it passes text through as content."""
        reasoning = self.reasoning_cls(thinking_open=self.thinking_open(prompt)) if self.reasoning_cls else None
        tool = self.tool_cls(tools) if (self.tool_cls is not None and parse_tools and tools) else None
        return ParserPipeline(reasoning, tool)

    def reply_structure(self, prompt: str, tools: list[dict] | None, constraint: ToolCallConstraint | None,
                        requested: RequestedStructure | None) -> RequestedStructure | None:
        """The grammar a reply follows: the tool-call parser's for constrained calls, or the requested one.

        When the prompt leaves a reasoning block open, the reasoning runs free and the grammar
        applies after the reasoning parser's end tag. Raises ``APIError`` (400) for what cannot be served.
        """
        if constraint is not None:
            if requested is not None:
                raise bad_request(f"{requested[1]} cannot be combined with a tool_choice that constrains tool calls",
                                  param=requested[1])
            requested = self._tool_structure(tools or [], constraint)
        if requested is None:
            return None
        spec, param = requested
        if self.thinking_open(prompt):
            end_tag = self.reasoning_cls.end_tag
            if end_tag is None:
                raise not_supported(f"structured output after an open reasoning block with the "
                                    f"{self.reasoning_name} reasoning parser", param=param)
            spec = spec.after_reasoning(end_tag)
        return spec, param

    def _tool_structure(self, tools: list[dict], constraint: ToolCallConstraint) -> RequestedStructure:
        what = "strict tools" if not constraint.required else "a tool_choice that forces a call"
        if self.tool_cls is None:
            raise bad_request(f"{what} needs a tool-call parser (--tool-call-parser)", param="tool_choice")
        try:
            spec = self.tool_cls.tool_call_grammar(tools, constraint)
        except InvalidRequestError as exc:
            raise bad_request(str(exc), param="tools") from exc
        if spec is None:
            raise not_supported(f"{what} with the {self.tool_name} tool-call parser", param="tool_choice")
        return spec, "tools"

    def describe(self) -> str:
        return f"reasoning parser {self.reasoning_name or 'none'}, tool-call parser {self.tool_name or 'none'}"


def _load(registry: Any, kind: str, requested: str | None, default: str | None) -> tuple[str | None, type | None]:
    if requested == DISABLED:
        return None, None
    name = requested or default
    if not name:
        return None, None
    try:
        spec = registry.parsers.get(name)
        if spec.kind != kind:
            raise PluginError(f"parser {name!r} is a {spec.kind} parser, not a {kind} parser")
        return name, spec.load()
    except (PluginError, ImportError, AttributeError) as exc:
        if requested:
            raise PluginError(f"{kind} parser {name!r} cannot be used: {exc}") from exc
        log.warning("the model's default %s parser %r cannot be loaded (%s); responses will not be parsed for it",
                    kind, name, exc)
        return None, None


def _markup_is_special(tokenizer: Any, markup: tuple[str, ...]) -> bool:
    if tokenizer is None or not markup:
        return False
    special = set(tokenizer.all_special_ids)
    return any(tokenizer.token_to_id(s) in special for s in markup)
