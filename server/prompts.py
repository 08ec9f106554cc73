"""Both protocols' conversations -> chat-template messages -> prompt text and token ids."""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from armillary.server.errors import APIError, bad_request, not_supported
from armillary.structured.spec import ToolCallConstraint
from armillary.server.protocol_anthropic import (
    DocumentBlock,
    ImageBlock,
    Message,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    Tool,
    ToolResultBlock,
    ToolUseBlock,
)
from armillary.server.protocol_openai import ChatMessage, ToolDef

# Names the renderer itself passes; a request may not smuggle them in as template variables.
_RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "chat_template", "documents",
                                       "special_tokens"})


@dataclass(slots=True)
class RenderedPrompt:
    text: str
    token_ids: list[int]


def template_kwargs(server_defaults: dict[str, Any], request_kwargs: dict[str, Any] | None,
                    **overrides: Any) -> dict[str, Any]:
    """Server defaults, then protocol-derived values (``overrides`` that are not None), then the request's own."""
    merged = dict(server_defaults)
    merged.update({k: v for k, v in overrides.items() if v is not None})
    for key, value in (request_kwargs or {}).items():
        if key in _RESERVED_TEMPLATE_KWARGS:
            raise bad_request(f"chat_template_kwargs may not set {key!r}", param="chat_template_kwargs")
        merged[key] = value
    return merged


def render_chat(tokenizer: Any, messages: list[dict], tools: list[dict] | None, kwargs: dict[str, Any],
                add_generation_prompt: bool = True, max_model_len: int | None = None) -> RenderedPrompt:
    """Apply the checkpoint's chat template and tokenize (the template writes any BOS itself). Blocking: run it
    on a worker thread.

    ``max_model_len``: refuse a prompt that does not fit (``context_length_exceeded``), before
    tokenizing when its length alone proves it. ``InvalidRequestError`` from the template (bad
    roles, ``raise_exception``) propagates as a 400.
    """
    if tokenizer is None:
        raise bad_request("this model has no tokenizer and so no chat template; use /v1/completions with token ids")
    text = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=add_generation_prompt,
                                         **kwargs)
    return RenderedPrompt(text, encode_prompt(tokenizer, text, False, max_model_len, "messages"))


def encode_prompt(tokenizer: Any, text: str, add_special_tokens: bool, max_model_len: int | None,
                  param: str | None) -> list[int]:
    """Tokenize a prompt (blocking); with ``max_model_len``, a prompt that leaves no room to generate is a 400."""
    if max_model_len is not None and len(text) > max_model_len * max_chars_per_token(tokenizer):
        raise context_length_error(f"the prompt has {len(text)} characters, so more tokens than this model's maximum "
                                   f"context length of {max_model_len}", param)
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    if max_model_len is not None and len(ids) >= max_model_len:
        raise context_length_error(f"the prompt has {len(ids)} tokens; this model's maximum context length is "
                                   f"{max_model_len}, prompt and output together", param)
    return ids


def context_length_error(message: str, param: str | None) -> APIError:
    return APIError(400, message, param=param, code="context_length_exceeded")


@functools.lru_cache(maxsize=8)
def max_chars_per_token(tokenizer: Any) -> int:
    """A bound on the characters one token stands for, so ``characters > bound × tokens`` proves a prompt too long.

    A token's text is at most its vocabulary entry (byte-level entries hold one character per
    byte); the factor 4 and the floor of 128 cover normalizers that shorten text (NFC joins up to
    three code points) and unknown-word tokens.
    """
    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    longest = max((len(token) for token in vocab), default=1)
    return max(4 * longest, 128)


# ---- OpenAI

def _text_of_parts(content: str | list[dict] | None, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind in ("text", "input_text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in ("text", "input_text"):
            raise bad_request(f"{where}[{j}].text must be a string", param=f"{where}[{j}].text")
        else:
            raise not_supported(f"content part type {kind!r} (this server reads text only)", param=f"{where}[{j}]")
    return "\n".join(texts)


def openai_messages(messages: Sequence[ChatMessage]) -> list[dict]:
    """OpenAI chat messages -> template messages (developer -> system, text parts joined)."""
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}].content"
        content = _text_of_parts(m.content, where)
        if content is None and m.role != "assistant":
            raise bad_request(f"{where} is required for a {m.role} message", param=where)
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
        if m.name is not None:
            msg["name"] = m.name
        if m.role == "assistant":
            reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
            if reasoning is not None:
                msg["reasoning_content"] = reasoning
            if m.tool_calls:
                msg["tool_calls"] = [{"id": c.id or f"call_{i}_{k}", "type": "function",
                                      "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                     for k, c in enumerate(m.tool_calls)]
        if m.role == "tool":
            if m.tool_call_id is None:
                raise bad_request(f"messages[{i}].tool_call_id is required for a tool message",
                                  param=f"messages[{i}].tool_call_id")
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def openai_tools(tools: Sequence[ToolDef] | None) -> list[dict] | None:
    if not tools:
        return None
    return [t.model_dump(exclude_none=True) for t in tools]


@dataclass(slots=True)
class ToolChoice:
    """What a request's ``tool_choice`` means for one reply.

    ``parse_tools``: the tools go into the prompt and calls are parsed out of the reply.
    ``constraint``: how calls are constrained by grammar; None: not at all.
    """

    parse_tools: bool
    constraint: ToolCallConstraint | None = None


def _tool_names(tools: list[dict] | None) -> tuple[str, ...]:
    return tuple(t["function"]["name"] for t in tools or [])


def _strict_names(tools: list[dict] | None) -> frozenset[str]:
    return frozenset(t["function"]["name"] for t in tools or [] if t["function"].get("strict") is True)


def _forced(tools: list[dict] | None, names: tuple[str, ...], parallel: bool, param: str) -> ToolChoice:
    """Calls required: of one of ``names`` (all tools when empty), every argument checked against its schema."""
    known = _tool_names(tools)
    if not known:
        raise bad_request("a tool_choice that forces a call needs tools", param=param)
    for name in names:
        if name not in known:
            raise bad_request(f"tool_choice names {name!r}, which is not among the tools ({', '.join(known)})",
                              param=param)
    allowed = names or known
    return ToolChoice(True, ToolCallConstraint(True, allowed, frozenset(allowed), parallel))


def _auto(tools: list[dict] | None, parallel: bool) -> ToolChoice:
    """Free choice; with strict tools, a call the model opens is constrained (strict ones to their schema)."""
    strict = _strict_names(tools)
    if not strict:
        return ToolChoice(tools is not None)
    return ToolChoice(True, ToolCallConstraint(False, _tool_names(tools), strict, parallel))


def openai_tool_choice(tool_choice: str | dict | None, tools: list[dict] | None,
                       parallel_tool_calls: bool | None) -> ToolChoice:
    """``auto`` (the default with tools), ``none``, ``required``, or ``{"type": "function", "function": {"name"}}``.

    A named function is called exactly once; ``required`` allows several calls unless
    ``parallel_tool_calls`` is false.
    """
    parallel = parallel_tool_calls is not False
    if tool_choice is None or tool_choice == "auto":
        return _auto(tools, parallel)
    if tool_choice == "none":
        return ToolChoice(False)
    if tool_choice == "required":
        return _forced(tools, (), parallel, "tool_choice")
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise bad_request("tool_choice.function.name must be a string", param="tool_choice.function.name")
        return _forced(tools, (name,), False, "tool_choice")
    raise bad_request(f"tool_choice must be 'auto', 'none', 'required' or a function, got {tool_choice!r}",
                      param="tool_choice")


# ---- Anthropic

def _system_text(system: str | list[TextBlock] | None) -> str | None:
    if system is None or isinstance(system, str):
        return system
    return "\n".join(block.text for block in system)


def _tool_result_text(block: ToolResultBlock, where: str) -> str:
    if block.content is None:
        return ""
    if isinstance(block.content, str):
        return block.content
    texts = []
    for j, part in enumerate(block.content):
        if not isinstance(part, TextBlock):
            raise not_supported(f"{part.type} content in tool_result (this server reads text only)",
                                param=f"{where}.content[{j}]")
        texts.append(part.text)
    return "\n".join(texts)


def anthropic_messages(system: str | list[TextBlock] | None, messages: Sequence[Message]) -> list[dict]:
    """Anthropic conversation -> template messages.

    ``tool_use`` blocks become the assistant's ``tool_calls``; a user turn's ``tool_result`` blocks
    become ``tool`` messages (before the turn's text, where Anthropic requires them); ``thinking``
    becomes ``reasoning_content``.
    """
    out: list[dict] = []
    system_text = _system_text(system)
    if system_text:
        out.append({"role": "system", "content": system_text})
    for i, m in enumerate(messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts: list[str] = []
        reasoning: list[str] = []
        calls: list[dict] = []
        for j, block in enumerate(m.content):
            where = f"messages[{i}].content[{j}]"
            if isinstance(block, TextBlock):
                texts.append(block.text)
            elif isinstance(block, (ImageBlock, DocumentBlock)):
                raise not_supported(f"{block.type} content blocks (this server reads text only)", param=where)
            elif isinstance(block, ToolResultBlock):
                if m.role != "user":
                    raise bad_request(f"{where}: tool_result blocks belong in user messages", param=where)
                out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "content": _tool_result_text(block, where)})
            elif isinstance(block, ToolUseBlock):
                if m.role != "assistant":
                    raise bad_request(f"{where}: tool_use blocks belong in assistant messages", param=where)
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name, "arguments": block.input}})
            elif isinstance(block, ThinkingBlock):
                reasoning.append(block.thinking)
            elif isinstance(block, RedactedThinkingBlock):
                continue  # opaque to us: nothing to render
        if m.role == "user":
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
            continue
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
        if reasoning:
            msg["reasoning_content"] = "".join(reasoning)
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def anthropic_tools(tools: Sequence[Tool] | None) -> list[dict] | None:
    """Anthropic tools in OpenAI function form, which chat templates and tool parsers read."""
    if not tools:
        return None
    converted = []
    for i, tool in enumerate(tools):
        if tool.type not in (None, "custom"):
            raise not_supported(f"server tool type {tool.type!r}", param=f"tools[{i}]")
        function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description is not None:
            function["description"] = tool.description
        if tool.strict is not None:
            function["strict"] = tool.strict
        converted.append({"type": "function", "function": function})
    return converted


def anthropic_tool_choice(tool_choice: Any, tools: list[dict] | None) -> ToolChoice:
    """``auto`` (default), ``none``, ``any`` (some call required) or ``tool`` (that tool, once).

    ``disable_parallel_tool_use`` limits ``auto`` and ``any`` to one call.
    """
    parallel = tool_choice is None or not tool_choice.disable_parallel_tool_use
    if tool_choice is None or tool_choice.type == "auto":
        return _auto(tools, parallel)
    if tool_choice.type == "none":
        return ToolChoice(False)
    if tool_choice.type == "any":
        return _forced(tools, (), parallel, "tool_choice")
    if not tool_choice.name:
        raise bad_request("tool_choice of type 'tool' needs a name", param="tool_choice.name")
    return _forced(tools, (tool_choice.name,), False, "tool_choice")


def thinking_flag(thinking: Any) -> bool:
    """Anthropic's thinking is opt-in: any type but ``disabled`` -> ``enable_thinking``; absent -> off."""
    return thinking is not None and thinking.type != "disabled"

