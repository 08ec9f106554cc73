"""Building blocks of tool-call grammars (xgrammar structural tags) shared by the tool-call formats.

Pieces every format's grammar module repeats: structural-tag elements, the call list for a
``ToolCallConstraint`` (required: ``tags_with_separator``; else ``triggered_tags`` on the call's
opening markup), a tool's parameters in schema order, and, for XML-style formats whose values are
raw text closed by an end tag (qwen3_coder, glm47), the typing of one value: a string-typed
parameter as raw text the format builds, any other as compact JSON (xgrammar's ``json_schema``).
All raise ``InvalidRequestError`` for what the markup cannot express.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from armillary.errors import InvalidRequestError
from armillary.parsers.arg_types import schema_types
from armillary.structured.spec import StructuredSpec, ToolCallConstraint

_NULL = "null"


def const(text: str) -> dict:
    return {"type": "const_string", "value": text}


def sequence(elements: list[dict]) -> dict:
    if not elements:
        return const("")
    return elements[0] if len(elements) == 1 else {"type": "sequence", "elements": elements}


def char_class(chars: set[str], negate: bool) -> str:
    """An EBNF character class of ``chars`` (or of every character but them)."""
    body = "".join("\\" + c if c in "]\\^-" else c for c in sorted(chars))
    return f"[^{body}]" if negate else f"[{body}]"


def check_markup_name(name: str, what: str, breakers: tuple[str, ...], markup: str) -> None:
    """A tool or parameter name must be non-empty, unpadded and free of ``breakers`` to sit in the markup."""
    if not name or any(b in name for b in breakers) or name != name.strip():
        raise InvalidRequestError(f"{what} {name!r} cannot be written in {markup} tool-call markup")


def allowed_functions(tools: list[dict], constraint: ToolCallConstraint) -> Iterator[tuple[str, dict]]:
    """(name, OpenAI function dict) of each tool ``constraint`` allows, in its order; an unknown name raises."""
    by_name = {}
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            by_name[function["name"]] = function
    for name in constraint.allowed:
        if name not in by_name:
            raise InvalidRequestError(f"tool {name!r} is not among the request's tools")
        yield name, by_name[name]


def calls_spec(tags: list[dict], constraint: ToolCallConstraint, trigger: str, separator: str) -> StructuredSpec:
    """The structural tag of one reply's calls: ``tags`` (one per tool), ``separator`` between calls."""
    if not tags:
        raise InvalidRequestError("no tool to call")
    if constraint.required:
        calls = {"type": "tags_with_separator", "tags": tags, "separator": separator, "at_least_one": True,
                 "stop_after_first": not constraint.parallel}
    else:
        calls = {"type": "triggered_tags", "triggers": [trigger], "tags": tags,
                 "stop_after_first": not constraint.parallel}
    return StructuredSpec.structural_tag({"format": calls})


def object_parameters(where: str, parameters: Any) -> tuple[dict, list, dict, list[str]]:
    """(properties, required, definitions, names in schema order, required extras last) of a parameters schema."""
    if parameters is None:
        parameters = {}
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise InvalidRequestError(f"{where}: parameters must be a JSON schema of type object")
    properties = parameters.get("properties") or {}
    required = parameters.get("required") or []
    if not isinstance(properties, dict) or not isinstance(required, list):
        raise InvalidRequestError(f"{where}: properties must be an object and required a list")
    definitions = {k: parameters[k] for k in ("$defs", "definitions") if isinstance(parameters.get(k), dict)}
    return properties, required, definitions, [*properties, *(r for r in required if r not in properties)]


def raw_string_options(schema: dict, end: str, nullable: bool, where: str, what: str) -> dict | None:
    """A raw string value limited to its enum / const values (None: the schema has neither).

    Options holding ``end`` cannot be written; the word ``null`` only when null is allowed (it reads
    back as JSON null). ``what`` names a value in the error, e.g. "a glm47 argument".
    """
    options = schema.get("enum") if "enum" in schema else ([schema["const"]] if "const" in schema else None)
    if options is None:
        return None
    texts = [o for o in options if isinstance(o, str) and end not in o and (o != _NULL or nullable)]
    if nullable and None in options:
        texts.append(_NULL)
    if not texts:
        raise InvalidRequestError(f"{where}: none of its enum values can be written as {what}")
    return {"type": "or", "elements": [const(t) for t in dict.fromkeys(texts)]}


def _string_member(schema: dict) -> dict:
    """The part of a schema that describes its string values (an anyOf / oneOf member, or itself)."""
    for key in ("anyOf", "oneOf"):
        for member in schema.get(key) or []:
            if isinstance(member, dict) and "string" in schema_types(member):
                return _string_member(member)
    return schema


def raw_value_format(schema: Any, definitions: dict, where: str,
                     string_value: Callable[[dict, bool, str], dict]) -> dict:
    """What a raw-text VALUE may be: ``string_value(string schema, nullable, where)`` for a string-typed
    parameter, else compact JSON following the schema (with the tool's ``$defs`` / ``definitions``)."""
    schema = schema if isinstance(schema, dict) else {}
    types = schema_types(schema)
    if "string" in types:
        nullable = "null" in types or None in (schema.get("enum") or [])
        return string_value(_string_member(schema), nullable, where)
    return {"type": "json_schema", "json_schema": {**definitions, **schema}}
