"""String scanning helpers shared by streaming parsers: find tags, hold back partial tags."""
from __future__ import annotations

from collections.abc import Iterable


def partial_tag_len(text: str, tags: Iterable[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``tags``.

    That suffix may still grow into a tag, so a streaming parser holds it back until decided.
    """
    longest = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), longest, -1):
            if text.endswith(tag[:k]):
                longest = k
                break
    return longest


def find_first_tag(text: str, tags: Iterable[str], start: int = 0) -> tuple[int, str] | None:
    """Position and value of the earliest complete tag in ``text[start:]`` (ties: the longest tag)."""
    best: tuple[int, str] | None = None
    for tag in tags:
        pos = text.find(tag, start)
        if pos < 0:
            continue
        if best is None or pos < best[0] or (pos == best[0] and len(tag) > len(best[1])):
            best = (pos, tag)
    return best


def undecided_prefix(text: str, expected: str) -> bool:
    """True while ``text`` (leading whitespace ignored) could still become ``expected``."""
    stripped = text.lstrip()
    return len(stripped) < len(expected) and expected.startswith(stripped)
