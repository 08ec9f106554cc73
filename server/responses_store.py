"""The in-memory store of Responses API responses: bounded in count, entries expire after a TTL, oldest evicted first."""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True)
class StoredResponse:
    """A response and the conversation it continues: ``history`` are the template messages before its output."""

    response: dict
    history: list[dict]  # chat-template messages: the input the response answered (previous turns included)
    output_messages: list[dict]  # the response's own output, as template messages
    stored_at: float


class ResponseStore:
    """``max_entries`` responses at most (the oldest goes first), each kept ``ttl_s`` seconds."""

    def __init__(self, max_entries: int = 1024, ttl_s: float = 3600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_entries < 1 or ttl_s <= 0:
            raise ValueError("the response store needs max_entries >= 1 and a positive TTL")
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(self, response: dict, history: list[dict], output_messages: list[dict]) -> None:
        self._expire()
        key = response["id"]
        self._entries.pop(key, None)
        self._entries[key] = StoredResponse(response, history, output_messages, self._clock())
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        return self._entries.get(response_id)

    def update(self, response_id: str, response: dict) -> None:
        entry = self.get(response_id)
        if entry is not None:
            entry.response = response

    def delete(self, response_id: str) -> bool:
        self._expire()
        return self._entries.pop(response_id, None) is not None

    def _expire(self) -> None:
        cutoff = self._clock() - self.ttl_s
        while self._entries:
            key, entry = next(iter(self._entries.items()))
            if entry.stored_at > cutoff:
                return
            del self._entries[key]
