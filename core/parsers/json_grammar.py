"""Grammars of JSON tool calls: the hermes and llama3_json formats, and forced calls on a model without a tool parser.

Each is written so that its parser reads back exactly what it allows, with arguments that follow
the tool's JSON schema (compact JSON, as the core writes every ``json_schema`` format):

- hermes: ``<tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>`` blocks, separated by a
  newline when calls are required, triggered by ``<tool_call>`` inside free text otherwise;
- llama3_json: ``{"name": "NAME", "parameters": ARGS}`` objects separated by ``"; "``; free text
  (with strict tools under ``auto``) must not open with ``{``, or it would read as a call;
- forced calls without a parser (vLLM's way): a JSON array of ``{"name", "parameters"}`` objects
  (at most one when calls are not parallel), or, for a call of one named tool, that tool's bare
  arguments object.
"""
from __future__ import annotations

import json
from typing import Any

from armillary.errors import InvalidRequestError
from armillary.structured.spec import StructuredSpec, ToolCallConstraint

_EMPTY_PARAMETERS = {"type": "object", "properties": {}}
_ANY_OBJECT = {"type": "object", "additionalProperties": True}  # the core's JSON is strict: say "any" aloud
_DEFINITIONS = ("$defs", "definitions")
# free text that cannot be taken for a llama3_json call: empty, blank, or not opening with '{'
_NOT_A_CALL_TEXT = "[ \\t\\r\\n]*([^ \\t\\r\\n{][\\s\\S]*)?"


def tool_functions(tools: list[dict]) -> dict[str, dict]:
    """name -> function record, for tools in OpenAI function form."""
    found: dict[str, dict] = {}
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            found[function["name"]] = function
    return found


def parameters_schema(name: str, function: dict) -> dict:
    """A tool's parameters schema (no parameters: the empty object); 400 unless it describes an object."""
    params = function.get("parameters")
    if params is None:
        return dict(_EMPTY_PARAMETERS)
    if not isinstance(params, dict) or params.get("type", "object") != "object":
        raise InvalidRequestError(f"tool {name!r}: parameters must be a JSON schema of type object")
    return params


def _allowed(tools: list[dict], constraint: ToolCallConstraint) -> list[tuple[str, dict]]:
    """(name, arguments schema) per tool a call may name, in the constraint's order."""
    functions = tool_functions(tools)
    out = []
    for name in constraint.allowed:
        if name not in functions:
            raise InvalidRequestError(f"tool {name!r} is not among the request's tools")
        checked = name in constraint.schema_checked
        out.append((name, parameters_schema(name, functions[name]) if checked else dict(_ANY_OBJECT)))
    if not out:
        raise InvalidRequestError("no tool to call")
    return out


def _call_tag(begin: str, schema: dict, end: str) -> dict:
    return {"type": "tag", "begin": begin, "content": {"type": "json_schema", "json_schema": schema}, "end": end}


def _calls(tags: list[dict], separator: str, constraint: ToolCallConstraint) -> dict:
    return {"type": "tags_with_separator", "tags": tags, "separator": separator, "at_least_one": True,
            "stop_after_first": not constraint.parallel}


def hermes_call_grammar(tools: list[dict], constraint: ToolCallConstraint) -> StructuredSpec:
    tags = [_call_tag(f'<tool_call>\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": ', schema,
                      "}\n</tool_call>") for name, schema in _allowed(tools, constraint)]
    if constraint.required:
        body = _calls(tags, "\n", constraint)
    else:
        body = {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": tags,
                "stop_after_first": not constraint.parallel}
    return StructuredSpec.structural_tag({"format": body})


def llama3_json_call_grammar(tools: list[dict], constraint: ToolCallConstraint) -> StructuredSpec:
    tags = [_call_tag(f'{{"name": {json.dumps(name, ensure_ascii=False)}, "parameters": ', schema, "}")
            for name, schema in _allowed(tools, constraint)]
    body = _calls(tags, "; ", constraint)
    if not constraint.required:
        body = {"type": "or", "elements": [body, {"type": "regex", "pattern": _NOT_A_CALL_TEXT}]}
    return StructuredSpec.structural_tag({"format": body})


# ---- forced calls without a tool parser

def forced_single_tool(constraint: ToolCallConstraint) -> str | None:
    """The tool of a reply that is exactly one call of one known tool (its bare arguments are written), else None."""
    if constraint.required and len(constraint.allowed) == 1 and not constraint.parallel:
        return constraint.allowed[0]
    return None


def _hoist_definitions(schemas: list[dict]) -> tuple[list[dict], dict[str, Any]]:
    """Move each schema's ``$defs`` / ``definitions`` to the root, where their ``#/$defs/...`` refs point."""
    hoisted: dict[str, Any] = {}
    out = []
    for schema in schemas:
        schema = dict(schema)
        for key in _DEFINITIONS:
            defs = schema.pop(key, None)
            if not isinstance(defs, dict):
                continue
            table = hoisted.setdefault(key, {})
            for def_name, def_schema in defs.items():
                if def_name in table and table[def_name] != def_schema:
                    raise InvalidRequestError(f"tools define {key} {def_name!r} differently; "
                                              "give each definition its own name")
                table[def_name] = def_schema
        out.append(schema)
    return out, hoisted


def forced_json_schema(tools: list[dict], constraint: ToolCallConstraint) -> dict:
    """The JSON schema of a forced reply on a model without a tool parser."""
    if not constraint.required:
        raise InvalidRequestError("only a tool_choice that forces a call is served without a tool-call parser")
    allowed = _allowed(tools, constraint)
    single = forced_single_tool(constraint)
    if single is not None:
        return allowed[0][1]
    schemas, definitions = _hoist_definitions([schema for _, schema in allowed])
    items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
              "required": ["name", "parameters"], "additionalProperties": False}
             for (name, _), schema in zip(allowed, schemas)]
    array: dict[str, Any] = {"type": "array", "minItems": 1,
                             "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not constraint.parallel:
        array["maxItems"] = 1
    array.update(definitions)
    return array


def forced_json_grammar(tools: list[dict], constraint: ToolCallConstraint) -> StructuredSpec:
    return StructuredSpec.json_schema(forced_json_schema(tools, constraint), "tools")
