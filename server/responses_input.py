"""Responses API requests -> chat-template messages, OpenAI-form tools, a tool choice and an output format."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from armillary.errors import InvalidRequestError
from armillary.server.errors import bad_request, not_supported
from armillary.server.protocol_responses import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    InputItem,
    InputMessage,
    ReasoningItem,
    TextConfig,
)
from armillary.server.sampling import RequestedStructure
from armillary.structured.spec import StructuredSpec

_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "summary_text", "reasoning_text"})


def _text(content: str | list[dict[str, Any]], where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind in _TEXT_PARTS:
            if not isinstance(part.get("text"), str):
                raise bad_request(f"{where}[{j}].text must be a string", param=f"{where}[{j}].text")
            texts.append(part["text"])
        else:
            raise not_supported(f"content part type {kind!r} (this server reads text only)", param=f"{where}[{j}]")
    return "\n".join(texts)


def _reasoning_text(item: ReasoningItem, where: str) -> str:
    parts = item.content if item.content else item.summary
    return _text(parts, f"{where}.content" if item.content else f"{where}.summary")


def input_messages(items: str | Sequence[InputItem]) -> list[dict]:
    """``input`` -> template messages: calls join the assistant turn they follow, outputs become tool messages,
    reasoning items become the next assistant turn's ``reasoning_content``."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    reasoning: list[str] = []

    def assistant(content: str) -> dict:
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning:
            msg["reasoning_content"] = "\n".join(reasoning)
            reasoning.clear()
        out.append(msg)
        return msg

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if isinstance(item, InputMessage):
            content = _text(item.content, f"{where}.content")
            if item.role == "assistant":
                assistant(content)
            else:
                out.append({"role": "system" if item.role == "developer" else item.role, "content": content})
        elif isinstance(item, FunctionCallItem):
            last = out[-1] if out and not reasoning else None
            msg = last if last is not None and last["role"] == "assistant" else assistant("")
            msg.setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}})
        elif isinstance(item, FunctionCallOutputItem):
            output = _text(item.output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        elif isinstance(item, ReasoningItem):
            reasoning.append(_reasoning_text(item, where))
    return out


def output_messages(output: list[dict]) -> list[dict]:
    """A response's output items as the template messages a follow-up turn replays."""
    msg: dict[str, Any] | None = None
    reasoning: list[str] = []
    messages: list[dict] = []
    for item in output:
        if item["type"] == "reasoning":
            reasoning.append("".join(p["text"] for p in item.get("content") or []))
            continue
        if msg is None:
            msg = {"role": "assistant", "content": ""}
            messages.append(msg)
        if reasoning:
            msg["reasoning_content"] = "\n".join(reasoning)
            reasoning.clear()
        if item["type"] == "message":
            msg["content"] += "".join(p["text"] for p in item["content"])
        elif item["type"] == "function_call":
            msg.setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": item["arguments"]}})
    if msg is None and reasoning:
        messages.append({"role": "assistant", "content": "", "reasoning_content": "\n".join(reasoning)})
    return messages


def chat_tools(tools: Sequence[FunctionTool] | None) -> list[dict] | None:
    """Flat Responses function tools -> chat-completions form (what templates and tool parsers read)."""
    if not tools:
        return None
    converted = []
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise not_supported(f"tool type {tool.type!r} (this server runs function tools only)", param=f"tools[{i}]")
        if not tool.name:
            raise bad_request(f"tools[{i}].name is required", param=f"tools[{i}].name")
        function: dict[str, Any] = {"name": tool.name, "parameters": tool.parameters or {"type": "object"}}
        if tool.description is not None:
            function["description"] = tool.description
        if tool.strict is not None:
            function["strict"] = tool.strict
        converted.append({"type": "function", "function": function})
    return converted


def chat_tool_choice(tool_choice: str | dict | None) -> str | dict | None:
    """Responses' ``{"type": "function", "name": N}`` -> chat's ``{"type": "function", "function": {"name": N}}``."""
    if isinstance(tool_choice, dict):
        if tool_choice.get("type") != "function":
            raise not_supported(f"tool_choice type {tool_choice.get('type')!r}", param="tool_choice")
        name = tool_choice.get("name")
        if not isinstance(name, str):
            raise bad_request("tool_choice.name must be a string", param="tool_choice.name")
        return {"type": "function", "function": {"name": name}}
    return tool_choice


def requested_format(text: TextConfig | None) -> RequestedStructure | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredSpec.json_object(), "text.format"
    if fmt.schema_ is None:
        raise bad_request("text.format.schema is required for a json_schema format", param="text.format.schema")
    try:
        return StructuredSpec.json_schema(fmt.schema_, "text.format.schema"), "text.format.schema"
    except InvalidRequestError as exc:
        raise bad_request(str(exc), param="text.format.schema") from exc


def thinking_kwargs(effort: str | None) -> dict[str, Any]:
    """``reasoning.effort`` -> template variables: ``none`` turns thinking off, others pass the effort on."""
    if effort is None:
        return {}
    if effort == "none":
        return {"enable_thinking": False}
    return {"reasoning_effort": effort}
