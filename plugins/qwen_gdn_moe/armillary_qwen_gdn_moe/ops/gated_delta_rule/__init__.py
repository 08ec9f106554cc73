"""Gated delta rule (Gated DeltaNet's recurrence) over packed variable-length sequences."""
from __future__ import annotations

from armillary_qwen_gdn_moe.ops.gated_delta_rule.naive import (
    chunk_gated_delta_rule_ref,
    recurrent_gated_delta_rule_ref,
)

__all__ = ["chunk_gated_delta_rule_ref", "recurrent_gated_delta_rule_ref"]
