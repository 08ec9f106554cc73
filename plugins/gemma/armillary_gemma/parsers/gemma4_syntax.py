"""Gemma 4's tool-call argument syntax, read into Python values.

The chat template writes a call as ``call:NAME{key:VALUE,...}`` (its ``format_argument`` macro):
strings between ``<|"|>`` quotes (written verbatim, no escapes), numbers / ``true`` / ``false``
bare, objects ``{key:VALUE,...}`` with bare keys (or ``<|"|>``-quoted ones), arrays
``[VALUE,...]``. A bare word that is no JSON literal is read as a string (``None`` / ``True`` /
``False``, as Jinja prints Python's, as null and booleans).
"""
from __future__ import annotations

import json
import re
from typing import Any

QUOTE = '<|"|>'
_BARE_END = ",}]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")  # tool and key names the syntax can carry bare
_PYTHON_WORDS = {"None": None, "True": True, "False": False}


class SyntaxError_(ValueError):
    """The text is not (or not yet) a complete call in Gemma 4's syntax."""


def bare_name_ok(name: str) -> bool:
    return _NAME.fullmatch(name) is not None


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _quoted(text: str, i: int) -> tuple[str, int]:
    end = text.find(QUOTE, i + len(QUOTE))
    if end < 0:
        raise SyntaxError_("unterminated string")
    return text[i + len(QUOTE):end], end + len(QUOTE)


def _bare(text: str, i: int) -> tuple[Any, int]:
    j = i
    while j < len(text) and text[j] not in _BARE_END and not text.startswith(QUOTE, j):
        j += 1
    word = text[i:j].strip()
    if not word:
        raise SyntaxError_(f"a value expected at {i}")
    if word in _PYTHON_WORDS:
        return _PYTHON_WORDS[word], j
    try:
        value = json.loads(word)
    except ValueError:
        return word, j
    return value, j


def parse_value(text: str, i: int) -> tuple[Any, int]:
    """The value starting at ``text[i]`` (whitespace skipped) and the index after it."""
    i = _skip(text, i)
    if text.startswith(QUOTE, i):
        return _quoted(text, i)
    if i >= len(text):
        raise SyntaxError_("a value expected at the end")
    if text[i] == "{":
        return parse_object(text, i)
    if text[i] == "[":
        items, i = [], _skip(text, i + 1)
        if i < len(text) and text[i] == "]":
            return items, i + 1
        while True:
            value, i = parse_value(text, i)
            items.append(value)
            i = _skip(text, i)
            if i >= len(text):
                raise SyntaxError_("unterminated array")
            if text[i] == "]":
                return items, i + 1
            if text[i] != ",":
                raise SyntaxError_(f"',' or ']' expected at {i}")
            i += 1
    return _bare(text, i)


def parse_object(text: str, i: int) -> tuple[dict, int]:
    """``{key:VALUE,...}`` at ``text[i] == "{"`` -> (dict, index after ``}``)."""
    out: dict[str, Any] = {}
    i = _skip(text, i + 1)
    if i < len(text) and text[i] == "}":
        return out, i + 1
    while True:
        i = _skip(text, i)
        if text.startswith(QUOTE, i):
            key, i = _quoted(text, i)
        else:
            m = _NAME.match(text, i)
            if m is None:
                raise SyntaxError_(f"a key expected at {i}")
            key, i = m.group(0), m.end()
        i = _skip(text, i)
        if i >= len(text) or text[i] != ":":
            raise SyntaxError_(f"':' expected after key {key!r}")
        out[key], i = parse_value(text, i + 1)
        i = _skip(text, i)
        if i >= len(text):
            raise SyntaxError_("unterminated object")
        if text[i] == "}":
            return out, i + 1
        if text[i] != ",":
            raise SyntaxError_(f"',' or '}}' expected at {i}")
        i += 1


def parse_calls(body: str) -> list[tuple[str, dict]]:
    """Every ``call:NAME{...}`` of one ``<|tool_call>`` block (separated by whitespace or commas)."""
    calls, i = [], _skip(body, 0)
    while i < len(body):
        if not body.startswith("call:", i):
            raise SyntaxError_(f"'call:' expected at {i}")
        m = _NAME.match(body, i + len("call:"))
        if m is None:
            raise SyntaxError_("a tool name expected after 'call:'")
        i = _skip(body, m.end())
        if i >= len(body) or body[i] != "{":
            raise SyntaxError_("'{' expected after the tool name")
        args, i = parse_object(body, i)
        calls.append((m.group(0), args))
        while i < len(body) and body[i] in " \t\r\n,":
            i += 1
    if not calls:
        raise SyntaxError_("no call in the block")
    return calls


def find_block_end(text: str, end_tag: str) -> int:
    """Index of the first ``end_tag`` outside ``<|"|>`` strings, or -1."""
    i, inside = 0, False
    while True:
        q = text.find(QUOTE, i)
        e = -1 if inside else text.find(end_tag, i)
        if e >= 0 and (q < 0 or e < q):
            return e
        if q < 0:
            return -1
        inside, i = not inside, q + len(QUOTE)
