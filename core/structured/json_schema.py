"""JSON schemas rewritten before xgrammar sees them, where its grammar would not match the schema.

xgrammar writes a string with ``minLength`` / ``maxLength`` as raw characters that exclude quotes
and backslashes but let control characters through unescaped (invalid JSON). The same bounds as a
``pattern`` go through its JSON-string regex mode, which escapes every character properly. It
also drops the bounds silently when a ``pattern`` or ``format`` is present; armillary refuses
that combination instead of returning strings the schema rejects.
"""
from __future__ import annotations

import copy
from typing import Any

from armillary.errors import InvalidRequestError

# keywords whose value is a schema, a list of schemas, or a name -> schema map
_SCHEMA_VALUE = ("additionalProperties", "additionalItems", "items", "not", "if", "then", "else", "contains",
                 "propertyNames", "unevaluatedProperties", "unevaluatedItems")
_SCHEMA_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SCHEMA_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _allows_string(schema: dict) -> bool:
    declared = schema.get("type")
    return declared == "string" or (isinstance(declared, list) and "string" in declared)


def _length_pattern(schema: dict, where: str) -> str:
    low = schema.get("minLength", 0)
    high = schema.get("maxLength")
    for key, value in (("minLength", low), ("maxLength", high)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise InvalidRequestError(f"{where}.{key} must be a non-negative integer, got {value!r}")
    if high is not None and high < low:
        raise InvalidRequestError(f"{where}: minLength {low} is greater than maxLength {high}")
    return f"^[\\s\\S]{{{low},{'' if high is None else high}}}$"


def _rewrite(schema: Any, where: str) -> None:
    """Rewrite ``schema`` in place, recursing into every sub-schema."""
    if not isinstance(schema, dict):
        return
    bounded = "minLength" in schema or "maxLength" in schema
    if bounded and _allows_string(schema) and "enum" not in schema and "const" not in schema:
        for other in ("pattern", "format"):
            if other in schema:
                raise InvalidRequestError(
                    f"{where}: minLength / maxLength together with {other} are not supported; keep one of them")
        schema["pattern"] = _length_pattern(schema, where)
        schema.pop("minLength", None)
        schema.pop("maxLength", None)
    for key in _SCHEMA_VALUE:
        if isinstance(schema.get(key), dict):
            _rewrite(schema[key], f"{where}.{key}")
    for key in _SCHEMA_LIST:
        if isinstance(schema.get(key), list):
            for i, member in enumerate(schema[key]):
                _rewrite(member, f"{where}.{key}[{i}]")
    for key in _SCHEMA_MAP:
        if isinstance(schema.get(key), dict):
            for name, member in schema[key].items():
                _rewrite(member, f"{where}.{key}.{name}")


def prepare_json_schema(schema: dict, where: str = "schema") -> dict:
    """A copy of ``schema`` that xgrammar turns into a grammar whose every output the schema accepts."""
    prepared = copy.deepcopy(schema)
    _rewrite(prepared, where)
    return prepared
