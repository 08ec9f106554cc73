"""Render Hugging Face chat templates (Jinja) the way transformers does, without transformers.

Same sandboxed environment (``trim_blocks``, ``lstrip_blocks``, loop controls), the same globals
(``raise_exception``, ``strftime_now``, a safe ``dict`` and ``namespace``), a ``tojson`` that keeps
non-ASCII text, and the same message normalisation: keys set to ``None`` are dropped and a message's
reasoning under ``thinking`` / ``reasoning`` is also offered as ``reasoning_content``.

One deliberate difference: tool-call ``arguments`` given as a JSON string (the OpenAI wire format)
are parsed into a mapping, because templates such as Qwen's iterate over them as a mapping and
silently render nothing for a string.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from armillary.errors import ArmillaryError, InvalidRequestError

# The first name is the one templates read; the others are older spellings of it.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ArmillaryError):
    """The chat template itself is broken (syntax error): a problem of the model files, not the request."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters and forces ASCII; templates expect plain json.dumps.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _DictBuilder:
    """``dict(...)`` for templates without exposing the ``dict`` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's ``namespace`` refusing underscore names, which could reach interpreter internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's trick so `self=` is a legal key
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set namespace attribute {name!r}")


@lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile (cached) a template in the sandboxed environment transformers uses."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _DictBuilder()
    env.globals["namespace"] = _Namespace
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not compile (line {e.lineno}): {e.message}") from e


def load_chat_template(value: str) -> str:
    """``--chat-template``: a template file's text, or the argument itself when it is an inline template.

    As vLLM decides: an argument with Jinja's characters (``{``, ``}`` or a newline) is a template;
    anything else is a path, and a path that cannot be read is an error (never a one-line template).
    The template is compiled here, so a broken one fails at start-up.
    """
    from pathlib import Path

    if any(c in value for c in "{}\n"):
        source = value
    else:
        path = Path(value).expanduser()
        try:
            source = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ChatTemplateError(f"chat template {value!r} looks like a file path but cannot be read "
                                    f"({exc.strerror or exc}); pass a readable .jinja file or the template text") from None
    try:
        compile_chat_template(source)
    except ChatTemplateError as exc:
        raise ChatTemplateError(f"--chat-template {value[:60]!r}: {exc}") from None
    return source


def _plain(value: Any) -> Any:
    """Rebuild ``value`` from plain JSON types so the template sees no object with methods of its own."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return f"<{type(value).__name__}>"


def _parsed_arguments(arguments: Any) -> Any:
    if not isinstance(arguments, str):
        return arguments
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    return parsed if isinstance(parsed, dict) else arguments


def _with_parsed_tool_calls(message: dict) -> dict:
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    fixed = []
    for call in calls:
        if isinstance(call, dict) and isinstance(call.get("function"), dict) and "arguments" in call["function"]:
            function = {**call["function"], "arguments": _parsed_arguments(call["function"]["arguments"])}
            call = {**call, "function": function}
        elif isinstance(call, dict) and "arguments" in call:
            call = {**call, "arguments": _parsed_arguments(call["arguments"])}
        fixed.append(call)
    return {**message, "tool_calls": fixed}


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Plain dict copies with ``None`` values dropped, reasoning aliased, tool-call arguments parsed."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InvalidRequestError("messages must be a list of message objects")
    if len(messages) == 0:
        raise InvalidRequestError("cannot apply the chat template to an empty conversation")
    normalized = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequestError(f"messages[{i}] must be an object, got {type(message).__name__}")
        plain = {k: v for k, v in _plain(message).items() if v is not None}
        reasoning = next((plain[k] for k in _REASONING_FIELDS if plain.get(k) is not None), None)
        if reasoning is not None:
            plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
        normalized.append(_with_parsed_tool_calls(plain))
    return normalized


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    special_tokens: Mapping[str, str] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    **template_kwargs: Any,
) -> str:
    """Render ``template`` over a conversation, as ``apply_chat_template(..., tokenize=False)`` does.

    ``special_tokens`` (``bos_token``, ``eos_token``, ...) are template variables that
    ``template_kwargs`` (e.g. ``enable_thinking``) may override. A ``raise_exception`` in the template
    and bad messages raise ``InvalidRequestError``.
    """
    compiled = compile_chat_template(template)
    chat = normalize_messages(messages)
    if tools is not None:
        for i, tool in enumerate(tools):
            if not isinstance(tool, Mapping):
                raise InvalidRequestError(f"tools[{i}] must be a JSON schema object, got {type(tool).__name__}")
    if documents is not None and any(not isinstance(d, Mapping) for d in documents):
        raise InvalidRequestError("documents must be objects with 'title' and 'text'")
    variables = {**(special_tokens or {}), **_plain(template_kwargs)}
    try:
        return compiled.render(messages=chat, tools=_plain(tools), documents=_plain(documents),
                               add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.exceptions.TemplateError as e:
        raise InvalidRequestError(f"chat template rejected the conversation: {e.message or e}") from e
    except TypeError as e:  # e.g. the template adds a string to a list of content parts
        raise InvalidRequestError(f"chat template cannot render the conversation: {e}") from e
