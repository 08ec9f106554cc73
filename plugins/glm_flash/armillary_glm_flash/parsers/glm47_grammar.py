"""The grammar of glm47 tool calls, written so that ``Glm47ToolParser`` reads back what it allows.

Each call is laid out as GLM-4.7's chat template writes it, calls back to back::

    <tool_call>NAME<arg_key>P</arg_key><arg_value>VALUE</arg_value>...</tool_call>

with the tool's parameters in schema order (required ones always, optional ones maybe). VALUE is
verbatim to the parser:

- a string-typed parameter's VALUE is the raw string: one of its enum / const values, its
  ``pattern``, or any text without ``</arg_value>`` (an automaton over characters) and never the
  bare word ``null`` (read as JSON null) unless the schema allows null;
- any other parameter's VALUE is compact JSON following its schema (xgrammar's ``json_schema``).

The result is an xgrammar structural tag: ``tags_with_separator`` when calls are required,
``triggered_tags`` on ``<tool_call>`` when free text may hold calls. Known gaps: a string's
``minLength`` / ``maxLength`` / ``format`` are not enforced on raw values, and a ``pattern`` that
matches ``null`` is not excluded from it.
"""
from __future__ import annotations

from typing import Any

from armillary.errors import InvalidRequestError
from armillary.parsers.arg_types import schema_types
from armillary.structured.spec import StructuredSpec, ToolCallConstraint

VALUE_END = "</arg_value>"
_NULL = "null"
_TRIGGER = "<tool_call>"
_NAME_BREAKERS = ("<", ">", "\n")


def _const(text: str) -> dict:
    return {"type": "const_string", "value": text}


def _sequence(elements: list[dict]) -> dict:
    if not elements:
        return _const("")
    return elements[0] if len(elements) == 1 else {"type": "sequence", "elements": elements}


def _char_class(chars: set[str], negate: bool) -> str:
    body = "".join("\\" + c if c in "]\\^-" else c for c in sorted(chars))
    return f"[^{body}]" if negate else f"[{body}]"


def raw_text_ebnf(end: str = VALUE_END, exclude_null: bool = True) -> str:
    """EBNF of any text that never contains ``end`` (and, with ``exclude_null``, is not exactly ``null``).

    A DFA over (m: how many characters of ``end`` the text ends with, KMP-style; p: how many
    characters of ``null`` the text equals so far, 5 once it differs), one rule per state, one
    character class per transition.
    """
    diverged = len(_NULL) + 1
    specials = set(end) | (set(_NULL) if exclude_null else set())

    def step(state: tuple[int, int], char: str | None) -> tuple[int, int] | None:
        """The state after ``char`` (None: a character outside ``specials``); None when ``end`` completes."""
        m, p = state
        text = end[:m] + (char or "\0")
        m = next((k for k in range(min(len(text), len(end)), -1, -1) if text.endswith(end[:k])), 0)
        if m == len(end):
            return None
        if exclude_null:
            p = p + 1 if p < len(_NULL) and char == _NULL[p] else diverged
        return m, p

    def name(state: tuple[int, int]) -> str:
        return f"v{state[0]}_{state[1]}"

    start = (0, 0)
    rules, seen, todo = [], {start}, [start]
    while todo:
        state = todo.pop()
        other = step(state, None)
        by_target: dict[tuple[int, int] | None, set[str]] = {}
        for char in specials:
            by_target.setdefault(step(state, char), set()).add(char)
        alternatives = [] if exclude_null and state[1] == len(_NULL) else ['""']
        routed = set()
        for target, chars in sorted(by_target.items(), key=lambda kv: str(kv[0])):
            if target is None or target == other:
                continue
            routed |= chars
            alternatives.append(f"{_char_class(chars, negate=False)} {name(target)}")
        dead = by_target.get(None, set())
        alternatives.append(f"{_char_class(routed | dead, negate=True)} {name(other)}")
        for target in [*by_target, other]:
            if target is not None and target not in seen:
                seen.add(target)
                todo.append(target)
        rules.append(f"{name(state)} ::= " + " | ".join(alternatives))
    return f"root ::= {name(start)}\n" + "\n".join(sorted(rules))


def _string_value(schema: dict, nullable: bool, where: str) -> dict:
    options = schema.get("enum") if "enum" in schema else ([schema["const"]] if "const" in schema else None)
    if options is not None:
        texts = [o for o in options if isinstance(o, str) and VALUE_END not in o and (o != _NULL or nullable)]
        if nullable and None in options:
            texts.append(_NULL)
        if not texts:
            raise InvalidRequestError(f"{where}: none of its enum values can be written as a glm47 argument")
        return {"type": "or", "elements": [_const(t) for t in dict.fromkeys(texts)]}
    if isinstance(schema.get("pattern"), str):
        value: dict = {"type": "regex", "pattern": schema["pattern"]}
    else:
        value = {"type": "grammar", "grammar": raw_text_ebnf(exclude_null=not nullable)}
    return {"type": "or", "elements": [value, _const(_NULL)]} if nullable and "pattern" in schema else value


def _string_member(schema: dict) -> dict:
    """The part of a schema describing its string values (an anyOf / oneOf member, or itself)."""
    for key in ("anyOf", "oneOf"):
        for member in schema.get(key) or []:
            if isinstance(member, dict) and "string" in schema_types(member):
                return _string_member(member)
    return schema


def _value(schema: Any, definitions: dict, where: str) -> dict:
    schema = schema if isinstance(schema, dict) else {}
    types = schema_types(schema)
    if "string" in types:
        nullable = "null" in types or None in (schema.get("enum") or [])
        return _string_value(_string_member(schema), nullable, where)
    return {"type": "json_schema", "json_schema": {**definitions, **schema}}


def _check_name(name: str, what: str) -> None:
    if not name or name != name.strip() or any(b in name for b in _NAME_BREAKERS):
        raise InvalidRequestError(f"{what} {name!r} cannot be written in glm47 tool-call markup")


def _arguments(name: str, parameters: Any) -> dict:
    where = f"tool {name!r}"
    parameters = {} if parameters is None else parameters
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise InvalidRequestError(f"{where}: parameters must be a JSON schema of type object")
    properties, required = parameters.get("properties") or {}, parameters.get("required") or []
    if not isinstance(properties, dict) or not isinstance(required, list):
        raise InvalidRequestError(f"{where}: properties must be an object and required a list")
    definitions = {k: parameters[k] for k in ("$defs", "definitions") if isinstance(parameters.get(k), dict)}
    blocks = []
    for param in [*properties, *(r for r in required if r not in properties)]:
        _check_name(param, f"{where}: argument")
        block = _sequence([_const(f"<arg_key>{param}</arg_key><arg_value>"),
                           _value(properties.get(param), definitions, f"{where}: argument {param!r}"),
                           _const(VALUE_END)])
        blocks.append(block if param in required else {"type": "optional", "content": block})
    return _sequence(blocks)


def _any_arguments() -> dict:
    """Arguments of a tool whose schema is not enforced: any keys, any raw values."""
    block = _sequence([_const("<arg_key>"), {"type": "regex", "pattern": "[^<>\\n]+"},
                       _const("</arg_key><arg_value>"),
                       {"type": "grammar", "grammar": raw_text_ebnf(exclude_null=False)}, _const(VALUE_END)])
    return {"type": "star", "content": block}


def glm47_call_grammar(tools: list[dict], constraint: ToolCallConstraint) -> StructuredSpec:
    """The structural tag for ``constraint`` over ``tools`` (OpenAI function form)."""
    by_name = {}
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            by_name[function["name"]] = function
    tags = []
    for name in constraint.allowed:
        if name not in by_name:
            raise InvalidRequestError(f"tool {name!r} is not among the request's tools")
        _check_name(name, "tool name")
        body = _arguments(name, by_name[name].get("parameters")) if name in constraint.schema_checked \
            else _any_arguments()
        tags.append({"type": "tag", "begin": f"{_TRIGGER}{name}", "content": body, "end": "</tool_call>"})
    if not tags:
        raise InvalidRequestError("no tool to call")
    if constraint.required:
        calls = {"type": "tags_with_separator", "tags": tags, "separator": "", "at_least_one": True,
                 "stop_after_first": not constraint.parallel}
    else:
        calls = {"type": "triggered_tags", "triggers": [_TRIGGER], "tags": tags,
                 "stop_after_first": not constraint.parallel}
    return StructuredSpec.structural_tag({"format": calls})
