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

from armillary.parsers.tool_grammar import (
    allowed_functions, calls_spec, char_class, check_markup_name, const, object_parameters, raw_string_options,
    raw_value_format, sequence,
)
from armillary.structured.spec import StructuredSpec, ToolCallConstraint

VALUE_END = "</arg_value>"
_NULL = "null"
_TRIGGER = "<tool_call>"
_NAME_BREAKERS = ("<", ">", "\n")


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
            alternatives.append(f"{char_class(chars, negate=False)} {name(target)}")
        dead = by_target.get(None, set())
        alternatives.append(f"{char_class(routed | dead, negate=True)} {name(other)}")
        for target in [*by_target, other]:
            if target is not None and target not in seen:
                seen.add(target)
                todo.append(target)
        rules.append(f"{name(state)} ::= " + " | ".join(alternatives))
    return f"root ::= {name(start)}\n" + "\n".join(sorted(rules))


def _string_value(schema: dict, nullable: bool, where: str) -> dict:
    options = raw_string_options(schema, VALUE_END, nullable, where, "a glm47 argument")
    if options is not None:
        return options
    if isinstance(schema.get("pattern"), str):
        value: dict = {"type": "regex", "pattern": schema["pattern"]}
    else:
        value = {"type": "grammar", "grammar": raw_text_ebnf(exclude_null=not nullable)}
    return {"type": "or", "elements": [value, const(_NULL)]} if nullable and "pattern" in schema else value


def _value(schema: Any, definitions: dict, where: str) -> dict:
    return raw_value_format(schema, definitions, where, _string_value)


def _check_name(name: str, what: str) -> None:
    check_markup_name(name, what, _NAME_BREAKERS, "glm47")


def _arguments(name: str, parameters: Any) -> dict:
    where = f"tool {name!r}"
    properties, required, definitions, names = object_parameters(where, parameters)
    blocks = []
    for param in names:
        _check_name(param, f"{where}: argument")
        block = sequence([const(f"<arg_key>{param}</arg_key><arg_value>"),
                           _value(properties.get(param), definitions, f"{where}: argument {param!r}"),
                           const(VALUE_END)])
        blocks.append(block if param in required else {"type": "optional", "content": block})
    return sequence(blocks)


def _any_arguments() -> dict:
    """Arguments of a tool whose schema is not enforced: any keys, any raw values."""
    block = sequence([const("<arg_key>"), {"type": "regex", "pattern": "[^<>\\n]+"},
                       const("</arg_key><arg_value>"),
                       {"type": "grammar", "grammar": raw_text_ebnf(exclude_null=False)}, const(VALUE_END)])
    return {"type": "star", "content": block}


def glm47_call_grammar(tools: list[dict], constraint: ToolCallConstraint) -> StructuredSpec:
    """The structural tag for ``constraint`` over ``tools`` (OpenAI function form)."""
    tags = []
    for name, function in allowed_functions(tools, constraint):
        _check_name(name, "tool name")
        body = _arguments(name, function.get("parameters")) if name in constraint.schema_checked \
            else _any_arguments()
        tags.append({"type": "tag", "begin": f"{_TRIGGER}{name}", "content": body, "end": "</tool_call>"})
    return calls_spec(tags, constraint, _TRIGGER, "")
