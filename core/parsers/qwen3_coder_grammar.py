"""The grammar of qwen3_coder tool calls, written so that ``Qwen3CoderToolParser`` reads back what it allows.

Each call is laid out as the chat template writes it::

    <tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>

with the tool's parameters in schema order (required ones always, optional ones maybe) and the
calls of one reply separated by a newline. The parser drops exactly the newline after
``<parameter=P>`` and the one before ``</parameter>``, so VALUE comes back verbatim:

- a string-typed parameter's VALUE is the raw string: text that never contains
  ``</parameter>`` (an automaton over characters), within minLength / maxLength, one of its
  enum / const values, or its pattern; never the bare word ``null`` (the parser reads that as
  JSON null) unless the schema allows null;
- any other parameter's VALUE is compact JSON following its schema (the core turns each
  ``json_schema`` format into xgrammar's grammar for it).

The result is an xgrammar structural tag (plain data): ``tags_with_separator`` when calls are
required, ``triggered_tags`` on ``<tool_call>`` when free text may hold calls. Known gaps: a
``pattern`` that matches the word ``null`` is not excluded from it, and a string ``format`` is
not enforced on raw values.
"""
from __future__ import annotations

import json
from typing import Any

from armillary.errors import InvalidRequestError
from armillary.parsers.tool_grammar import (
    allowed_functions, calls_spec, char_class, check_markup_name, const, object_parameters, raw_string_options,
    raw_value_format, sequence,
)
from armillary.structured.spec import StructuredSpec, ToolCallConstraint

PARAMETER_END = "</parameter>"
_NULL = "null"
_TRIGGER = "<tool_call>"
_HEADER_BREAKERS = (">", "\n", "<")  # a name holding one of these cannot be written in a tag header


def _ebnf_literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


# ---- raw string text

def _unbounded_text_ebnf(min_len: int, exclude_null: bool) -> str:
    """Text of at least ``min_len`` characters without ``</parameter>`` (and not exactly ``null``).

    A DFA over states (k: how much of ``</parameter>`` was just seen, c: characters so far capped
    where nothing depends on it any more, p: the text so far is a prefix of ``null``), written as
    right-recursive rules with one character class per transition.
    """
    end = PARAMETER_END
    cap = max(min_len, len(_NULL) + 1 if exclude_null else 0)
    specials = set(end) | (set(_NULL) if exclude_null else set())

    def step(state: tuple[int, int, bool], char: str | None) -> tuple[int, int, bool] | None:
        """The next state after ``char`` (None: any non-special character); None when it completes the end tag."""
        k, count, prefix = state
        if char is not None and char == end[k]:
            k += 1
            if k == len(end):
                return None
        else:
            k = 1 if char == end[0] else 0
        prefix = prefix and count < len(_NULL) and char == _NULL[count]
        return k, min(count + 1, cap), prefix

    def name(state: tuple[int, int, bool]) -> str:
        return f"t{state[0]}_{state[1]}_{int(state[2])}"

    start = (0, 0, exclude_null)
    rules: list[str] = []
    seen, todo = {start}, [start]
    while todo:
        state = todo.pop()
        targets: dict[tuple[int, int, bool] | None, set[str]] = {}
        for char in specials:
            targets.setdefault(step(state, char), set()).add(char)
        other = step(state, None)
        alternatives = []
        if state[1] >= min_len and not (exclude_null and state[2] and state[1] == len(_NULL)):
            alternatives.append('""')
        for target, chars in targets.items():
            if target is None or target == other:
                continue
            alternatives.append(f"{char_class(chars, negate=False)} {name(target)}")
        # every character not sent elsewhere goes where a plain character goes
        elsewhere = {c for target, chars in targets.items() if target != other for c in chars}
        alternatives.append(f"{char_class(elsewhere, negate=True)} {name(other)}")
        for target in [*targets, other]:
            if target is not None and target not in seen:
                seen.add(target)
                todo.append(target)
        rules.append(f"{name(state)} ::= " + " | ".join(alternatives))
    return f"root ::= {name(start)}\n" + "\n".join(sorted(rules))


def _bounded_text_ebnf(min_len: int, max_len: int, exclude_null: bool) -> str:
    """Text of ``min_len..max_len`` characters without ``</parameter>`` (and not exactly ``null``).

    Under 12 characters the end tag cannot occur, so any character goes; longer texts leave out
    ``<`` altogether (a bounded count and the end-tag automaton would multiply).
    """
    banned = set() if max_len < len(PARAMETER_END) else {"<"}

    def chars(extra: set[str] = frozenset()) -> str:
        return char_class(banned | extra, negate=True)

    def run(low: int, high: int) -> list[str]:
        if low > high:
            return []
        return ['""'] if high == 0 else [f"{chars()}{{{low},{high}}}"]

    if not exclude_null or not min_len <= len(_NULL) <= max_len:
        return "root ::= " + " | ".join(run(min_len, max_len))
    # length 4 is "null" or not: everything else of that length, by where it first differs
    four = [" ".join([*(_ebnf_literal(c) for c in _NULL[:i]), chars({_NULL[i]}), *[chars()] * (3 - i)])
            for i in range(len(_NULL))]
    branches = run(min_len, len(_NULL) - 1) + four + run(len(_NULL) + 1, max_len)
    return "root ::= " + " | ".join(branches)


def _string_value(schema: dict, nullable: bool, where: str) -> dict:
    """The raw-text format of a string-typed value."""
    options = raw_string_options(schema, PARAMETER_END, nullable, where, "a qwen3_coder parameter")
    if options is not None:
        return options
    if isinstance(schema.get("pattern"), str):
        value = {"type": "regex", "pattern": schema["pattern"]}
    else:
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        if not isinstance(low, int) or (high is not None and not isinstance(high, int)) or low < 0 \
                or (high is not None and high < low):
            raise InvalidRequestError(f"{where}: invalid minLength / maxLength")
        ebnf = _unbounded_text_ebnf(low, not nullable) if high is None else _bounded_text_ebnf(low, high, not nullable)
        value = {"type": "grammar", "grammar": ebnf}
    return {"type": "or", "elements": [value, const(_NULL)]} if nullable else value


def _value_format(schema: Any, definitions: dict, where: str) -> dict:
    """What VALUE may be for a parameter with this schema (see the module doc)."""
    return raw_value_format(schema, definitions, where, _string_value)


# ---- calls

def _check_name(name: str, what: str) -> None:
    check_markup_name(name, what, _HEADER_BREAKERS, "qwen3_coder")


def _parameters(name: str, parameters: Any) -> dict:
    """The body of a call to a tool with this parameters schema: its parameter blocks in order."""
    where = f"tool {name!r}"
    properties, required, definitions, names = object_parameters(where, parameters)
    blocks = []
    for param in names:
        _check_name(param, f"{where}: parameter")
        value = _value_format(properties.get(param), definitions, f"{where}: parameter {param!r}")
        block = sequence([const(f"<parameter={param}>\n"), value, const(f"\n{PARAMETER_END}\n")])
        blocks.append(block if param in required else {"type": "optional", "content": block})
    return sequence(blocks)


def _any_parameters() -> dict:
    """Parameters of a tool whose arguments are not checked: any names, any text."""
    block = sequence([const("<parameter="), {"type": "regex", "pattern": "[^<>\\n]+"}, const(">\n"),
                       {"type": "grammar", "grammar": _unbounded_text_ebnf(0, exclude_null=False)},
                       const(f"\n{PARAMETER_END}\n")])
    return {"type": "star", "content": block}


def _call_tag(name: str, body: dict) -> dict:
    return {"type": "tag", "begin": f"{_TRIGGER}\n<function={name}>\n", "content": body,
            "end": "</function>\n</tool_call>"}


def qwen3_coder_call_grammar(tools: list[dict], constraint: ToolCallConstraint) -> StructuredSpec:
    """The structural tag for ``constraint`` over ``tools`` (OpenAI function form)."""
    tags = []
    for name, function in allowed_functions(tools, constraint):
        _check_name(name, "tool name")
        checked = name in constraint.schema_checked
        tags.append(_call_tag(name, _parameters(name, function.get("parameters")) if checked
                              else _any_parameters()))
    return calls_spec(tags, constraint, _TRIGGER, "\n")
