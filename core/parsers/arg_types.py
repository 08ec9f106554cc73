"""Typing of tool-call arguments written as raw text (XML-style formats) by their JSON schema.

Formats such as qwen3_coder write every argument as text between tags; the request's JSON
schema says what the text means. Conversion never fails: text that does not parse as the
schema's type stays a string, so a call is never lost to a formatting slip.
"""
from __future__ import annotations

import ast
import json
import math
from typing import Any

_NULL = "null"
_ENUM_VALUE_TYPES = {str: "string", bool: "boolean", int: "integer", float: "number"}


def schema_types(schema: dict | None) -> set[str]:
    """The JSON types a property schema allows (empty: untyped or unknown)."""
    if not isinstance(schema, dict):
        return set()
    declared = schema.get("type")
    if isinstance(declared, str):
        return {declared.lower()}
    if isinstance(declared, list):
        return {t.lower() for t in declared if isinstance(t, str)}
    found: set[str] = set()
    for key in ("anyOf", "oneOf"):
        for member in schema.get(key) or []:
            found |= schema_types(member)
    if found:
        return found
    if isinstance(schema.get("enum"), list):
        return {_ENUM_VALUE_TYPES[type(v)] for v in schema["enum"] if type(v) in _ENUM_VALUE_TYPES}
    if "properties" in schema:
        return {"object"}
    if "items" in schema:
        return {"array"}
    return set()


def is_string_schema(schema: dict | None) -> bool:
    """Whether a value for this schema is taken verbatim as a string (and so can be streamed)."""
    return "string" in schema_types(schema)


def convert_argument(raw: str, schema: dict | None) -> Any:
    """Convert argument text to a JSON value for a property schema (None: untyped).

    ``null`` is JSON null for every type. string: the text itself. integer / number / boolean:
    parsed, else the text. object / array: JSON, else a Python literal, else the text. Untyped:
    JSON, else the text.
    """
    if raw == _NULL:
        return None
    types = schema_types(schema)
    if not types:
        return _json_or_text(raw)
    if "string" in types:
        return raw
    text = raw.strip()
    for kind in ("boolean", "integer", "number", "object", "array"):
        if kind not in types:
            continue
        try:
            return _PARSERS[kind](text)
        except ValueError:
            continue
    if text == _NULL:
        return None
    return raw


def _json_or_text(raw: str) -> Any:
    try:
        return _strict_json(raw)
    except ValueError:
        return raw


def _strict_json(text: str) -> Any:
    """json.loads without NaN / Infinity (they have no JSON text form)."""
    def reject(constant: str) -> Any:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=reject)


def _parse_boolean(text: str) -> bool:
    lowered = text.lower()
    if lowered not in ("true", "false"):
        raise ValueError(f"not a boolean: {text!r}")
    return lowered == "true"


def _parse_integer(text: str) -> int:
    value = _parse_number(text)
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"not an integer: {text!r}")
        return int(value)
    return value


def _parse_number(text: str) -> int | float:
    try:
        value = _strict_json(text)
    except ValueError:
        value = float(text)  # Python spellings JSON lacks: ".5", "1.", "+2"; ValueError if none
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"not a number: {text!r}")
    return value


def _parse_container(text: str, kind: type) -> Any:
    try:
        value = _strict_json(text)
    except ValueError:
        try:
            value = _json_compatible(ast.literal_eval(text))
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError) as exc:
            raise ValueError(f"not a {kind.__name__}: {text!r}") from exc
    if not isinstance(value, kind):
        raise ValueError(f"not a {kind.__name__}: {text!r}")
    return value


def _json_compatible(value: Any) -> Any:
    """A Python literal as JSON data (tuples become lists); ValueError for what JSON cannot hold."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("non-finite float")
        return value
    if isinstance(value, (list, tuple)):
        return [_json_compatible(v) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise ValueError("non-string object key")
        return {k: _json_compatible(v) for k, v in value.items()}
    raise ValueError(f"{type(value).__name__} has no JSON form")


_PARSERS = {
    "boolean": _parse_boolean,
    "integer": _parse_integer,
    "number": _parse_number,
    "object": lambda text: _parse_container(text, dict),
    "array": lambda text: _parse_container(text, list),
}
