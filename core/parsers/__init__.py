"""Protocol-neutral tool-call and reasoning parser contracts."""
from __future__ import annotations

from armillary.parsers.base import (
    ParsedMessage,
    ParsedToolCall,
    ParserPipeline,
    ReasoningParser,
    ToolParser,
    new_tool_call_id,
    reduce_events,
)
from armillary.parsers.events import (
    ParserEvent,
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)

__all__ = [
    "ParsedMessage", "ParsedToolCall", "ParserEvent", "ParserPipeline", "ReasoningDelta", "ReasoningParser",
    "TextDelta", "ToolCallArgsDelta", "ToolCallEnd", "ToolCallStart", "ToolParser", "new_tool_call_id",
    "reduce_events",
]
