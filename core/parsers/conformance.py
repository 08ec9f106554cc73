"""Chunking-invariance checks for parser tests (core's and plugins').

A streaming parser must give the same message whatever the deltas look like. These helpers feed
one output text in many chunkings and check that every event stream is well formed and reduces
to the same message. They raise ``AssertionError`` so pytest reports them as test failures.
"""
from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator

from armillary.parsers.base import ParsedMessage, ParserPipeline, reduce_events
from armillary.parsers.events import ParserEvent, TextDelta, ToolCallArgsDelta, ToolCallEnd, ToolCallStart


def chunkings(text: str, seeds: tuple[int, ...] = (0, 1, 2, 3), max_chunk: int = 9) -> Iterator[tuple[str, list[str]]]:
    """(label, chunks): whole, every split into two pieces, one character at a time, random sizes."""
    yield "whole", [text]
    for cut in range(1, len(text)):
        yield f"split@{cut}", [text[:cut], text[cut:]]
    yield "chars", list(text)
    for seed in seeds:
        rng = random.Random(seed)
        chunks, pos = [], 0
        while pos < len(text):
            size = rng.randint(1, max_chunk)
            chunks.append(text[pos:pos + size])
            pos += size
        yield f"random{seed}", chunks


def counting_ids() -> Callable[[], str]:
    """A deterministic id generator (``call_0``, ``call_1``, ...) so runs compare equal."""
    counter = iter(range(1 << 62))
    return lambda: f"call_{next(counter)}"


def run_chunks(pipeline: ParserPipeline, chunks: list[str]) -> list[ParserEvent]:
    events: list[ParserEvent] = []
    for chunk in chunks:
        events.extend(pipeline.feed(chunk))
    events.extend(pipeline.finish())
    return events


def check_event_stream(events: list[ParserEvent], forbidden_in_text: tuple[str, ...] = ()) -> None:
    """Well-formedness: no empty deltas, calls indexed 0.. in order, each started once, argument
    deltas only inside a started call, concatenated deltas equal to the end's JSON object text,
    and no ``forbidden_in_text`` string inside any text delta."""
    open_calls: dict[int, str] = {}
    ended: set[int] = set()
    next_index = 0
    for event in events:
        if isinstance(event, ToolCallStart):
            _require(event.index == next_index, f"call index {event.index}, expected {next_index}")
            _require(bool(event.name), "tool call without a name")
            open_calls[event.index] = ""
            next_index += 1
        elif isinstance(event, ToolCallArgsDelta):
            _require(event.index in open_calls and event.index not in ended, f"argument delta outside call {event.index}")
            _require(bool(event.delta), "empty argument delta")
            open_calls[event.index] += event.delta
        elif isinstance(event, ToolCallEnd):
            _require(event.index in open_calls and event.index not in ended, f"end of call {event.index} not open")
            _require(open_calls[event.index] == event.arguments,
                     f"deltas {open_calls[event.index]!r} != arguments {event.arguments!r}")
            _require(isinstance(json.loads(event.arguments), dict), "arguments are not a JSON object")
            ended.add(event.index)
        else:
            _require(bool(event.text), f"empty {type(event).__name__}")
            if isinstance(event, TextDelta):
                for markup in forbidden_in_text:
                    _require(markup not in event.text, f"markup {markup!r} leaked into text {event.text!r}")
    _require(ended == set(open_calls), f"calls never ended: {sorted(set(open_calls) - ended)}")


def check_chunking_invariance(make_pipeline: Callable[[], ParserPipeline], text: str,
                              forbidden_in_text: tuple[str, ...] = ()) -> ParsedMessage:
    """Feed ``text`` in every chunking of ``chunkings``; all must reduce to one message, returned.

    ``make_pipeline`` builds a fresh pipeline whose tool parser uses ``counting_ids()``. Markup
    is checked per reduced content too, so a tag split over two text deltas is caught.
    """
    expected: ParsedMessage | None = None
    for label, chunks in chunkings(text):
        events = run_chunks(make_pipeline(), chunks)
        check_event_stream(events, forbidden_in_text)
        message = reduce_events(events)
        for markup in forbidden_in_text:
            _require(markup not in message.content, f"{label}: markup {markup!r} in content {message.content!r}")
        if expected is None:
            expected = message
        _require(message == expected, f"{label}: {message} != whole-text {expected}")
    _require(expected is not None, "no chunking was run")
    return expected


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)
