"""Streaming detokenization of one sequence: token ids in, text deltas out.

Uses the prefix / read offset technique (as in vLLM and TGI): each step decodes only the short
window ``ids[prefix_offset:]`` and compares it with ``ids[prefix_offset:read_offset]``, so the
cost per token stays bounded instead of re-decoding the whole output. A window whose text ends in
U+FFFD is an unfinished multi-byte character: nothing is emitted until a later token completes it.
"""
from __future__ import annotations

from collections.abc import Iterable

from armillary.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# Prompt tokens kept as left context, so the first generated token decodes as it would mid-text.
_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Per-sequence text state. ``add(id)`` returns the new text; ``flush()`` returns what is held back.

    Without ``prompt_ids`` the concatenated deltas equal ``tokenizer.decode(generated ids)``; with
    them, the generated text as it reads after the prompt.
    """

    __slots__ = ("_tokenizer", "_skip_special", "_ids", "_prefix_offset", "_read_offset", "_text")

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True,
                 prompt_ids: Iterable[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        context = list(prompt_ids)[-_PROMPT_CONTEXT_TOKENS:]
        self._ids: list[int] = context
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = len(context)  # end of the text already returned
        self._text: list[str] = []

    @property
    def text(self) -> str:
        """All text returned so far."""
        return "".join(self._text)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def add(self, token_id: int) -> str:
        """Feed one generated token; return the text it completes (may be ``""``)."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        window_text = self._decode(self._ids[self._prefix_offset:])
        if len(window_text) <= len(prefix_text) or window_text.endswith(_REPLACEMENT):
            return ""
        delta = window_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._text.append(delta)
        return delta

    def add_many(self, token_ids: Iterable[int]) -> str:
        return "".join(self.add(t) for t in token_ids)

    def flush(self) -> str:
        """At the end of the sequence: the held-back text (an unfinished character decodes as U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        window_text = self._decode(self._ids[self._prefix_offset:])
        delta = window_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        if delta:
            self._text.append(delta)
        return delta
