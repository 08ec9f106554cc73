"""Gated delta rule (Gated DeltaNet's recurrence) over packed variable-length sequences.

The naive references are exported here. The Triton kernels live in ``chunk`` (chunked prefill:
``chunk_gated_delta_rule``, ``chunk_gated_delta_rule_slots``) and ``fused_recurrent`` (the fused
decode step: ``fused_gdn_decode``); import those modules directly, where the GPU path needs them, so
that importing this package does not define Triton kernels (under TRITON_INTERPRET the mode is
fixed when a kernel is defined).
"""
from __future__ import annotations

from armillary_qwen_gdn_moe.ops.gated_delta_rule.naive import (
    chunk_gated_delta_rule_ref,
    recurrent_gated_delta_rule_ref,
)

__all__ = ["chunk_gated_delta_rule_ref", "recurrent_gated_delta_rule_ref"]
