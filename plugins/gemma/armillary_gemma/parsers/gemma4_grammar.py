"""The grammar of Gemma 4 tool calls, written so that ``Gemma4ToolParser`` reads back what it allows.

Each call is laid out as the chat template writes it, ``<|tool_call>call:NAME{key:VALUE,...}<tool_call|>``,
calls back to back. The arguments follow the tool's schema in Gemma's syntax (``gemma4_syntax``):
properties in schema order (required ones always, optional ones maybe), strings between ``<|"|>``
quotes holding any text but the quote, JSON numbers / booleans / null bare, nested objects and
arrays likewise; ``enum`` / ``const``, ``anyOf`` / ``oneOf``, type lists, ``$ref`` to ``$defs``
``items`` and string ``minLength`` / ``maxLength`` (a bounded string holds no ``<``) are followed.
Other keywords (numeric ranges, patterns, formats, item counts) are not enforced; a schema
without ``properties`` takes any arguments, ``properties: {}`` none. The result is an xgrammar structural tag.
"""
from __future__ import annotations

import json
from typing import Any

from armillary.errors import InvalidRequestError
from armillary.parsers.tool_grammar import allowed_functions, calls_spec
from armillary.structured.spec import StructuredSpec, ToolCallConstraint
from armillary_gemma.parsers.gemma4_syntax import QUOTE, bare_name_ok

_TRIGGER = "<|tool_call>"


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _quoted_text_rules() -> list[str]:
    """``str`` ::= <|"|> (any text without <|"|>) <|"|>, the inside as an automaton: state k = how much of
    the quote was just seen (the quote's one ``<`` restarts a match). Any state may end the text: the
    closing quote cannot overlap an earlier one, so the parser finds exactly it."""
    q, specials = QUOTE, sorted(set(QUOTE))
    rules = [f"str ::= {_lit(q)} s0 {_lit(q)}"]
    for k in range(len(q)):
        alts = ['""']
        for c in specials:
            target = k + 1 if c == q[k] else (1 if c == q[0] else 0)
            if target < len(q):
                alts.append(f"{_lit(c)} s{target}")
        escaped = "".join("\\" + c if c in "]\\^-" else c for c in specials)
        alts.append(f"[^{escaped}] s0")
        rules.append(f"s{k} ::= " + " | ".join(alts))
    return rules


class _Rules:
    """EBNF rules of one call's arguments, one rule per schema node."""

    def __init__(self, definitions: dict) -> None:
        self.definitions = definitions
        self.rules: list[str] = []
        self.count = 0
        self.any_used = False

    def new(self, body: str) -> str:
        name = f"r{self.count}"
        self.count += 1
        self.rules.append(f"{name} ::= {body}")
        return name

    def any_value(self) -> str:
        self.any_used = True
        return "anyv"

    def value(self, schema: Any, where: str) -> str:
        if not isinstance(schema, dict) or not schema:
            return self.any_value()
        if "$ref" in schema:
            ref = schema["$ref"]
            key = ref.rsplit("/", 1)[-1]
            if key not in self.definitions:
                raise InvalidRequestError(f"{where}: unresolvable $ref {ref!r}")
            return self.value(self.definitions[key], where)
        for options_key in ("enum", "const"):
            if options_key in schema:
                options = schema["enum"] if options_key == "enum" else [schema["const"]]
                return self.new(" | ".join(self.literal(o, where) for o in options))
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list):
                return self.new(" | ".join(self.value(m, where) for m in schema[key]))
        types = schema.get("type")
        if isinstance(types, list):
            return self.new(" | ".join(self.value({**schema, "type": t}, where) for t in types))
        if types == "string":
            return self.string(schema, where)
        if types == "integer":
            return "int"
        if types == "number":
            return "num"
        if types == "boolean":
            return self.new('"true" | "false"')
        if types == "null":
            return self.new('"null"')
        if types == "array":
            item = self.value(schema.get("items"), where)
            return self.new(f'"[" ({item} ("," {item})*)? "]"')
        if types == "object" or "properties" in schema:
            return self.obj(schema, where)
        return self.any_value()

    def string(self, schema: dict, where: str) -> str:
        """Any text between quotes; with ``maxLength``, ``minLength..maxLength`` characters other than ``<``."""
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        if high is None:
            return "str"
        if not isinstance(low, int) or not isinstance(high, int) or not 0 <= low <= high:
            raise InvalidRequestError(f"{where}: invalid minLength / maxLength")
        inner = '""' if high == 0 else f"[^<]{{{low},{high}}}"
        return self.new(f"{_lit(QUOTE)} {inner} {_lit(QUOTE)}")

    def literal(self, value: Any, where: str) -> str:
        if isinstance(value, str):
            if QUOTE in value:
                raise InvalidRequestError(f"{where}: enum value {value!r} cannot be written in Gemma 4's syntax")
            return _lit(QUOTE + value + QUOTE)
        if isinstance(value, bool) or value is None or isinstance(value, (int, float)):
            return _lit(json.dumps(value))
        raise InvalidRequestError(f"{where}: enum value {value!r} is not a scalar")

    def members(self, schema: dict, where: str) -> str:
        """``key:VALUE`` pairs in schema order, commas between the ones written."""
        properties = schema.get("properties") or {}
        required = schema.get("required") or []
        if "properties" not in schema and not required:  # an object of anything
            self.any_used = True
            return self.new('(anykey ":" anyv ("," anykey ":" anyv)*)?')
        names = [*properties, *(r for r in required if r not in properties)]
        if not names:
            return self.new('""')  # no parameters
        started, empty = '""', '""'  # the rules for "nothing after here", some written / none written yet
        for name in reversed(names):
            if not bare_name_ok(name):
                raise InvalidRequestError(f"{where}: property {name!r} cannot be a bare key in Gemma 4's syntax")
            pair = f'{_lit(name + ":")} {self.value(properties.get(name), f"{where}.{name}")}'
            if name in required:
                new_started = self.new(f'"," {pair} {started}')
                new_empty = self.new(f"{pair} {started}")
            else:
                new_started = self.new(f'"," {pair} {started} | {started}')
                new_empty = self.new(f"{pair} {started} | {empty}")
            started, empty = new_started, new_empty
        return empty

    def obj(self, schema: dict, where: str) -> str:
        return self.new(f'"{{" {self.members(schema, where)} "}}"')


_ANY = [
    'anyv ::= str | num | "true" | "false" | "null" | anyo | anya',
    'anyo ::= "{" (anykey ":" anyv ("," anykey ":" anyv)*)? "}"',
    'anya ::= "[" (anyv ("," anyv)*)? "]"',
    "anykey ::= [A-Za-z0-9_.\\-]+",
]
_NUMBERS = ['int ::= "-"? ("0" | [1-9] [0-9]*)',
            'num ::= int ("." [0-9]+)? ([eE] [-+]? [0-9]+)?']


def _arguments_ebnf(parameters: Any, where: str) -> str:
    """EBNF whose root is the text between the call's ``{`` and ``}``."""
    if parameters is None:
        parameters = {}
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise InvalidRequestError(f"{where}: parameters must be a JSON schema of type object")
    definitions = {**(parameters.get("definitions") or {}), **(parameters.get("$defs") or {})}
    rules = _Rules(definitions)
    root = rules.members(parameters, where) or '""'
    return "\n".join([f"root ::= {root}", *rules.rules, *_quoted_text_rules(), *_NUMBERS, *_ANY])


def gemma4_call_grammar(tools: list[dict], constraint: ToolCallConstraint) -> StructuredSpec:
    """The structural tag for ``constraint`` over ``tools`` (OpenAI function form)."""
    tags = []
    for name, function in allowed_functions(tools, constraint):
        if not bare_name_ok(name):
            raise InvalidRequestError(f"tool name {name!r} cannot be written in Gemma 4 tool-call markup")
        params = function.get("parameters") if name in constraint.schema_checked else {}
        content = {"type": "grammar", "grammar": _arguments_ebnf(params, f"tool {name!r}")}
        tags.append({"type": "tag", "begin": f"{_TRIGGER}call:{name}{{", "content": content, "end": "}<tool_call|>"})
    return calls_spec(tags, constraint, _TRIGGER, "\n")
