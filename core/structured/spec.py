"""What a request constrains its output to: protocol-neutral records, no xgrammar import."""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from armillary.errors import InvalidRequestError

JSON_SCHEMA = "json_schema"
JSON_OBJECT = "json_object"
REGEX = "regex"
CHOICE = "choice"
GRAMMAR = "grammar"
STRUCTURAL_TAG = "structural_tag"
KINDS = (JSON_SCHEMA, JSON_OBJECT, REGEX, CHOICE, GRAMMAR, STRUCTURAL_TAG)


def compact_json(value: Any) -> str:
    """JSON text without spaces; key order is kept, since it is the order a schema's properties are written in."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


@dataclass(slots=True, frozen=True)
class StructuredSpec:
    """A constraint on a sequence's output tokens; the engine compiles it once per distinct value.

    ``kind`` and ``source``:
    - ``json_schema``: the JSON schema as compact JSON text;
    - ``json_object``: any JSON object (``source`` is empty);
    - ``regex``: the pattern (the whole output matches it);
    - ``choice``: a JSON list of the allowed output strings;
    - ``grammar``: EBNF in xgrammar's (GBNF) dialect, root rule ``root``;
    - ``structural_tag``: an xgrammar structural tag as JSON text (tool-call formats).

    ``reasoning_end``: the prompt left a reasoning block open; the output runs free up to this tag
    and the constraint applies to what follows it.
    """

    kind: str
    source: str
    reasoning_end: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(f"unknown structured output kind {self.kind!r}; expected one of {KINDS}")

    @classmethod
    def json_schema(cls, schema: Any, where: str = "json_schema") -> StructuredSpec:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(f"{where} is not valid JSON: {exc}") from exc
        if not isinstance(schema, dict):
            raise InvalidRequestError(f"{where} must be a JSON schema object, got {type(schema).__name__}")
        return cls(JSON_SCHEMA, compact_json(schema))

    @classmethod
    def json_object(cls) -> StructuredSpec:
        return cls(JSON_OBJECT, "")

    @classmethod
    def regex(cls, pattern: Any, where: str = "regex") -> StructuredSpec:
        if not isinstance(pattern, str) or not pattern:
            raise InvalidRequestError(f"{where} must be a non-empty string")
        return cls(REGEX, pattern)

    @classmethod
    def choice(cls, options: Any, where: str = "choice") -> StructuredSpec:
        if not isinstance(options, list) or not options:
            raise InvalidRequestError(f"{where} must be a non-empty list of strings")
        for i, option in enumerate(options):
            if not isinstance(option, str):
                raise InvalidRequestError(f"{where}[{i}] must be a string, got {type(option).__name__}")
        return cls(CHOICE, compact_json(list(options)))

    @classmethod
    def grammar(cls, ebnf: Any, where: str = "grammar") -> StructuredSpec:
        if not isinstance(ebnf, str) or not ebnf.strip():
            raise InvalidRequestError(f"{where} must be a non-empty EBNF string")
        return cls(GRAMMAR, ebnf)

    @classmethod
    def structural_tag(cls, tag: Any, where: str = "structural_tag") -> StructuredSpec:
        if isinstance(tag, str):
            try:
                tag = json.loads(tag)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(f"{where} is not valid JSON: {exc}") from exc
        if not isinstance(tag, dict) or not isinstance(tag.get("format"), dict):
            raise InvalidRequestError(f"{where} must be an object with a 'format' object")
        return cls(STRUCTURAL_TAG, compact_json({"type": "structural_tag", "format": tag["format"]}))

    def after_reasoning(self, end_tag: str | None) -> StructuredSpec:
        """The same constraint, applied after ``end_tag`` (None: from the first token)."""
        return replace(self, reasoning_end=end_tag or None)

    def describe(self) -> str:
        return self.kind.replace("_", " ")


@dataclass(slots=True, frozen=True)
class ToolCallConstraint:
    """How a reply's tool calls are constrained, for a tool parser to turn into its format's grammar.

    ``required``: the reply is one or more calls and nothing else (``tool_choice`` ``required`` /
    a named function / Anthropic ``any`` / ``tool``); otherwise free text in which a call the
    model opens must be well formed (``auto`` with strict tools). ``allowed``: the tools a call
    may name, in order. ``schema_checked``: the tools whose arguments follow their JSON schema
    (every allowed tool when required; the strict ones under auto); the others take any
    arguments. ``parallel``: several calls may follow one another.
    """

    required: bool
    allowed: tuple[str, ...]
    schema_checked: frozenset[str]
    parallel: bool = True
