"""The streamed JSON arguments of an XML-style tool call (raw-text values typed by the tool's schema).

Formats such as qwen3_coder and glm47 write each argument as ``name`` + raw text between tags;
their parsers find the tags and hand each value's text to an ``XmlArguments``, which writes the
call's arguments as ``ToolCallArgsDelta`` events (see ``XmlArguments`` for the contract).
"""
from __future__ import annotations

import json

from armillary.parsers.arg_types import convert_argument, is_string_schema
from armillary.parsers.events import ParserEvent, ToolCallArgsDelta, ToolCallEnd, ToolCallStart

_NULL = "null"


def _json_text(value: object) -> str:
    return json.dumps(value, ensure_ascii=False)


class XmlArguments:
    """One open call's arguments JSON, written as its values arrive.

    Contract: ``start_call`` emits ``ToolCallStart`` and ``{``; per value, ``begin_value(name)``,
    then any number of ``stream(piece)`` (only while ``streams``: the value is string-typed), then
    one ``finish_value(rest)`` with the text not yet streamed; ``close_call`` emits ``}`` and
    ``ToolCallEnd`` with ``text``, which is exactly the concatenation of the call's deltas. The JSON
    is ``json.dumps``-shaped (``", "`` / ``": "`` separators, ``ensure_ascii=False``). A value's key
    (with its separator) goes out with its first text: a streamed string opens its quote once the
    text cannot be the literal ``null`` and streams its escaped text from then on; any other value
    (and a string that stayed a prefix of ``null``) goes out whole at ``finish_value``, converted
    by ``convert_argument`` (so ``null`` is JSON null). A repeated name is written twice.
    """

    __slots__ = ("index", "text", "streams", "_properties", "_params", "_name", "_schema", "_quote_open",
                 "_undecided")

    def __init__(self) -> None:
        self.index = -1  # the open call's index
        self.text = ""  # argument JSON emitted so far
        self.streams = False  # the open value is string-typed: streamed as it arrives
        self._properties: dict = {}  # parameter name -> property schema
        self._params = 0  # values written so far
        self._name = ""
        self._schema: dict | None = None
        self._quote_open = False  # a streamed string value has written its opening quote
        self._undecided = ""  # start of a streamed value while it could still be the literal null

    def start_call(self, events: list[ParserEvent], index: int, call_id: str, name: str,
                   parameters: dict | None) -> None:
        """Open call ``index`` of tool ``name`` whose parameters schema is ``parameters`` (None: unknown)."""
        self.index = index
        self.text = ""
        self._params = 0
        properties = (parameters or {}).get("properties")
        self._properties = properties if isinstance(properties, dict) else {}
        events.append(ToolCallStart(index, call_id, name))
        self._emit(events, "{")

    def close_call(self, events: list[ParserEvent]) -> None:
        self._emit(events, "}")
        events.append(ToolCallEnd(self.index, self.text))

    def begin_value(self, name: str) -> None:
        schema = self._properties.get(name)
        self._name = name
        self._schema = schema if isinstance(schema, dict) else None
        self.streams = is_string_schema(self._schema)
        self._quote_open = False
        self._undecided = ""

    def stream(self, events: list[ParserEvent], piece: str) -> None:
        """More of a string value; the quote opens once the text cannot be the literal null."""
        if self._quote_open:
            if piece:
                self._emit(events, _json_text(piece)[1:-1])
            return
        self._undecided += piece
        if _NULL.startswith(self._undecided):
            return
        self._emit(events, self._key() + '"' + _json_text(self._undecided)[1:-1])
        self._quote_open = True
        self._undecided = ""

    def finish_value(self, events: list[ParserEvent], rest: str) -> None:
        """The value is complete; ``rest`` is its text not yet written (all of it if not streamed)."""
        if self._quote_open:
            self._emit(events, (_json_text(rest)[1:-1] if rest else "") + '"')
        else:
            raw = self._undecided + rest
            self._emit(events, self._key() + _json_text(convert_argument(raw, self._schema)))
        self._quote_open = False

    def _key(self) -> str:
        separator = ", " if self._params else ""
        self._params += 1
        return f"{separator}{_json_text(self._name)}: "

    def _emit(self, events: list[ParserEvent], text: str) -> None:
        self.text += text
        events.append(ToolCallArgsDelta(self.index, text))
