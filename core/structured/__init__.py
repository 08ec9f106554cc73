"""Structured output: grammar-constrained decoding with xgrammar (JSON schema, regex, choice, EBNF, tool calls).

Only the protocol-neutral records are exported here (``sampling_params`` imports them); the engine
side lives in ``armillary.structured.outputs`` and loads xgrammar on first use.
"""
from __future__ import annotations

from armillary.structured.spec import StructuredSpec, ToolCallConstraint

__all__ = ["StructuredSpec", "ToolCallConstraint"]
