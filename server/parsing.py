"""Which reasoning and tool-call parsers a server uses, and one parser pipeline per response choice."""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from armillary.errors import InvalidRequestError, PluginError
from armillary.parsers.base import ParserPipeline, ReasoningParser, ToolParser
from armillary.parsers.forced_json import ForcedJsonToolParser
from armillary.parsers.json_grammar import forced_single_tool
from armillary.server.errors import bad_request, not_supported
from armillary.server.prompts import ToolChoice
from armillary.server.sampling import RequestedStructure
from armillary.structured.spec import StructuredSpec, ToolCallConstraint

log = logging.getLogger("armillary.server")

DISABLED = "none"  # --tool-call-parser none / --reasoning-parser none
PARSER_KINDS = ("tool", "reasoning")

ToolParserFactory = Callable[[list[dict] | None], ToolParser]


def registered_parsers(registry: Any) -> dict[str, tuple[str, ...]]:
    """kind ("tool" / "reasoning") -> the names registered for it, sorted."""
    return {kind: tuple(sorted(p.name for p in registry.parsers.of_kind(kind))) for kind in PARSER_KINDS}


def describe_registered(registered: dict[str, tuple[str, ...]], kinds: tuple[str, ...] = PARSER_KINDS) -> str:
    """``registered tool parsers: hermes, llama3_json; reasoning parsers: qwen3`` (the kinds asked for)."""
    return "; ".join(f"registered {kind} parsers: {', '.join(registered.get(kind) or ('none',))}" for kind in kinds)


@dataclass(slots=True)
class ReplyPlan:
    """How one reply is read and constrained: its tool-call parser (None: calls are not parsed) and grammar."""

    tool_parser: ToolParserFactory | None
    structure: RequestedStructure | None


@dataclass(slots=True)
class ParserSetup:
    """The parser classes in use; ``keep_special_tokens``: a parser's markup is a special token, so
    detokenization must not skip special tokens or the parser would never see it."""

    reasoning_cls: type[ReasoningParser] | None = None
    tool_cls: type[ToolParser] | None = None
    reasoning_name: str | None = None
    tool_name: str | None = None
    keep_special_tokens: bool = False
    registered: dict[str, tuple[str, ...]] = field(default_factory=dict)  # kind -> registered names

    @classmethod
    def resolve(cls, registry: Any, arch: Any, tokenizer: Any, tool_parser: str | None,
                reasoning_parser: str | None) -> ParserSetup:
        """``tool_parser`` / ``reasoning_parser``: a registered name, ``"none"``, or None for the
        architecture's default. A named parser that cannot load is an error; a default one only warns."""
        registered = registered_parsers(registry)
        reasoning_name, reasoning_cls = _load(registry, "reasoning", reasoning_parser,
                                              getattr(arch, "default_reasoning_parser", None), registered)
        tool_name, tool_cls = _load(registry, "tool", tool_parser, getattr(arch, "default_tool_parser", None),
                                    registered)
        setup = cls(reasoning_cls, tool_cls, reasoning_name, tool_name, registered=registered)
        setup.keep_special_tokens = _markup_is_special(tokenizer, setup.markup_strings())
        return setup

    def check_auto_tool_choice(self, enabled: bool) -> None:
        """vLLM's start-up rule: ``--enable-auto-tool-choice`` needs a tool-call parser (named, or the model's default)."""
        if enabled and self.tool_cls is None:
            raise PluginError("--enable-auto-tool-choice needs a tool-call parser and this model has no default "
                              "one: add --tool-call-parser NAME (" + describe_registered(self.registered, ("tool",))
                              + ")")

    def markup_strings(self) -> tuple[str, ...]:
        found: list[str] = []
        for parser_cls in (self.reasoning_cls, self.tool_cls):
            if parser_cls is not None:
                found.extend(s for s in parser_cls.markup_strings if s not in found)
        return tuple(found)

    def thinking_open(self, prompt: str) -> bool:
        return self.reasoning_cls is not None and bool(self.reasoning_cls.prompt_opens_reasoning(prompt))

    def pipeline(self, prompt: str, tools: list[dict] | None, plan: ReplyPlan) -> ParserPipeline:
        """A fresh pipeline for one choice. Without parsers it passes text through as content."""
        reasoning = self.reasoning_cls(thinking_open=self.thinking_open(prompt)) if self.reasoning_cls else None
        tool = plan.tool_parser(tools) if (plan.tool_parser is not None and tools) else None
        return ParserPipeline(reasoning, tool)

    def plan(self, prompt: str, tools: list[dict] | None, choice: ToolChoice, requested: RequestedStructure | None,
             auto_tool_choice: bool = False) -> ReplyPlan:
        """The tool-call parser and grammar of one reply.

        Forced calls (``required``, a named function, Anthropic ``any`` / ``tool``) follow the tool
        parser's own grammar, or, when there is no parser or it has no grammar, vLLM's JSON form
        (``ForcedJsonToolParser``). ``auto`` with tools needs a tool parser (a 400 says how to
        start the server with one); strict tools under ``auto`` follow the parser's grammar. When
        the prompt leaves a reasoning block open, the reasoning runs free and the grammar applies
        after the reasoning parser's end tag. Raises ``APIError`` (400) for what cannot be served.
        """
        constraint = choice.constraint
        factory: ToolParserFactory | None = None
        if choice.parse_tools and tools:
            if constraint is not None and requested is not None:
                raise bad_request(f"{requested[1]} cannot be combined with a tool_choice that constrains tool calls",
                                  param=requested[1])
            if constraint is not None and constraint.required:
                factory, requested = self._forced(tools, constraint)
            elif self.tool_cls is None:
                raise bad_request(self._auto_refusal(auto_tool_choice), param="tool_choice")
            else:
                factory = self.tool_cls
                if constraint is not None:
                    requested = self._parser_grammar(tools, constraint, "strict tools")
        if requested is None:
            return ReplyPlan(factory, None)
        spec, param = requested
        if self.thinking_open(prompt):
            end_tag = self.reasoning_cls.end_tag
            if end_tag is None:
                raise not_supported(f"structured output after an open reasoning block with the "
                                    f"{self.reasoning_name} reasoning parser", param=param)
            spec = spec.after_reasoning(end_tag)
        return ReplyPlan(factory, (spec, param))

    def _forced(self, tools: list[dict], constraint: ToolCallConstraint) -> tuple[ToolParserFactory, RequestedStructure]:
        if self.tool_cls is not None:
            spec = _grammar_of(self.tool_cls, tools, constraint)
            if spec is not None:
                return self.tool_cls, (spec, "tools")
        single = forced_single_tool(constraint)
        spec = _grammar_of(ForcedJsonToolParser, tools, constraint)
        return functools.partial(ForcedJsonToolParser, single=single), (spec, "tools")

    def _parser_grammar(self, tools: list[dict], constraint: ToolCallConstraint, what: str) -> RequestedStructure:
        spec = _grammar_of(self.tool_cls, tools, constraint)
        if spec is None:
            raise not_supported(f"{what} with the {self.tool_name} tool-call parser", param="tools")
        return spec, "tools"

    def _auto_refusal(self, auto_tool_choice: bool) -> str:
        tool_parsers = describe_registered(self.registered, ("tool",))
        if auto_tool_choice:
            return ("tool_choice 'auto' needs a tool-call parser: --enable-auto-tool-choice is set, but this model "
                    f"has no default tool-call parser; restart with --tool-call-parser NAME ({tool_parsers}), or send "
                    "tool_choice 'required', 'none' or a named function")
        return ("tool_choice 'auto' (the default with tools) needs a tool-call parser, and this model has none: start "
                f"the server with --enable-auto-tool-choice --tool-call-parser NAME ({tool_parsers}), or send "
                "tool_choice 'required', 'none' or a named function, which work on any model")

    def describe(self) -> str:
        return f"reasoning parser {self.reasoning_name or 'none'}, tool-call parser {self.tool_name or 'none'}"


def _grammar_of(parser_cls: type[ToolParser], tools: list[dict], constraint: ToolCallConstraint) -> StructuredSpec | None:
    try:
        return parser_cls.tool_call_grammar(tools, constraint)
    except InvalidRequestError as exc:
        raise bad_request(str(exc), param="tools") from exc


def _load(registry: Any, kind: str, requested: str | None, default: str | None,
          registered: dict[str, tuple[str, ...]]) -> tuple[str | None, type | None]:
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
            raise PluginError(f"{kind} parser {name!r} cannot be used: {exc} ({describe_registered(registered)})") \
                from exc
        log.warning("the model's default %s parser %r cannot be loaded (%s); responses will not be parsed for it",
                    kind, name, exc)
        return None, None


def _markup_is_special(tokenizer: Any, markup: tuple[str, ...]) -> bool:
    if tokenizer is None or not markup:
        return False
    special = set(tokenizer.all_special_ids)
    return any(tokenizer.token_to_id(s) in special for s in markup)
