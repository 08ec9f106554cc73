"""What ``armillary serve`` checks before the weights load (the listening socket, flags, parser names), and start-up errors in one line.

Binding the socket first, as vLLM does, means a busy port or a bad host fails in a second,
not after minutes of loading; the bound socket is handed to uvicorn afterwards.
"""
from __future__ import annotations

import errno
import json
import socket
from typing import Any

from armillary.chat_template import ChatTemplateError
from armillary.errors import ArmillaryError, ModelNotFoundError, PluginError, WeightLoadError

_MEMORY_HINT = ("lower --max-model-len or --max-num-seqs, or give the cache more room "
                "(--gpu-memory-utilization on a GPU, --cpu-kv-cache-space-gb on the CPU)")


class StartupError(ArmillaryError):
    """A flag or the machine cannot work as given; reported in one line before anything loads."""


def bind_listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (0: a free port), not yet listening; ``StartupError`` if it cannot be."""
    if not 0 <= port <= 65535:
        raise StartupError(f"--port {port} is not a TCP port: give 1-65535, or 0 for a free one")
    try:
        infos = socket.getaddrinfo(host or None, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise StartupError(f"--host {host!r} cannot be listened on: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart within TIME_WAIT binds
        sock.bind(address)
    except OSError as exc:
        sock.close()
        where = f"{host}:{port}"
        if exc.errno == errno.EADDRINUSE:
            raise StartupError(f"cannot listen on {where}: the port is in use (another server?); "
                               f"pick another --port, or --port 0 for a free one") from None
        if exc.errno == errno.EACCES:
            raise StartupError(f"cannot listen on {where}: permission denied (ports below 1024 need "
                               f"privileges); pick a --port above 1023") from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise StartupError(f"cannot listen on {where}: {host!r} is not an address of this machine; "
                               f"use 127.0.0.1, 0.0.0.0 (every interface) or one of its own addresses") from None
        raise StartupError(f"cannot listen on {where}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def check_parser_names(registry: Any, tool_parser: str | None, reasoning_parser: str | None) -> None:
    """A named parser must be registered, of its kind, and importable; the error lists the registered ones by kind."""
    for kind, name, flag in (("tool", tool_parser, "--tool-call-parser"), ("reasoning", reasoning_parser,
                                                                            "--reasoning-parser")):
        if not name or name == "none":
            continue
        known = sorted(p.name for p in registry.parsers.of_kind(kind))
        if name not in known:
            other = "tool" if kind == "reasoning" else "reasoning"
            also = f" ({name!r} is a {other} parser)" if name in registry.parsers else ""
            raise StartupError(f"{flag} {name!r}: no such {kind} parser{also}; registered {kind} parsers: "
                               f"{', '.join(known) or 'none'}, or 'none'")
        try:
            registry.parsers.get(name).load()
        except Exception as exc:  # a plugin's parser module that does not import
            raise StartupError(f"{flag} {name!r} cannot be loaded: {type(exc).__name__}: {exc}") from None


def string_list(text: str) -> list[str]:
    """A CORS flag's value: a JSON list as vLLM takes it (``'["http://a", "http://b"]'``), or comma-separated."""
    text = text.strip()
    if text.startswith("["):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not a JSON list: {exc}") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError("must be a JSON list of strings")
        return value
    return [part.strip() for part in text.split(",") if part.strip()]


def describe_failure(exc: BaseException) -> tuple[str, str | None] | None:
    """(message, hint) for a mistake a user can fix, None for a bug (which keeps its traceback)."""
    message = str(exc) or type(exc).__name__
    if isinstance(exc, ModelNotFoundError):
        return message, "give a checkpoint directory, a .gguf file, or a repo id already in the Hugging Face cache"
    if isinstance(exc, WeightLoadError):
        return message, "the checkpoint's tensors do not fit its config.json: check that every shard is complete"
    if isinstance(exc, ChatTemplateError):
        return message, "--chat-template takes a .jinja file or the template text itself"
    if isinstance(exc, PluginError):
        return message, "`armillary plugins` lists what is installed, broken plugins included"
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":  # torch's is a RuntimeError
        return f"out of memory: {message}", _MEMORY_HINT
    if isinstance(exc, StartupError):
        return message, None
    if isinstance(exc, (ArmillaryError, ValueError)):
        return message, "see `armillary serve --help`"
    if isinstance(exc, OSError):
        return message, None
    return None
