"""Entry point of the qwen_gdn_moe plugin: what it serves, lazily named."""
from __future__ import annotations

from armillary.hookspecs import hookimpl

_PKG = "armillary_qwen_gdn_moe"
# the Qwen3.5 / Qwen3.6 model cards' sampling by mode (thinking: also for coding and tools)
_SAMPLING_DEFAULTS = {
    "thinking": {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0},
    "non_thinking": {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.0, "presence_penalty": 1.5},
}


@hookimpl
def armillary_register_architectures(registry) -> None:
    # qwen3_coder is core's (other families' templates write it too)
    common = dict(default_tool_parser="qwen3_coder", default_reasoning_parser="qwen3")
    # Qwen3-Next ships separate Instruct and Thinking checkpoints: their own generation_config.json suffices
    registry.register("qwen3_next", ["Qwen3NextForCausalLM"], f"{_PKG}.qwen3_next:Qwen3NextForCausalLM",
                      description="Qwen3-Next: GDN + gated attention + MoE", **common)
    registry.register("qwen3_5_moe", ["Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM"],
                      f"{_PKG}.qwen3_5:Qwen3_5MoeForCausalLM",
                      description="Qwen3.5 / Qwen3.6 MoE (text)", sampling_defaults=_SAMPLING_DEFAULTS, **common)
    registry.register("qwen3_5", ["Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM"],
                      f"{_PKG}.qwen3_5:Qwen3_5ForCausalLM",
                      description="Qwen3.5 / Qwen3.6 dense (text)", sampling_defaults=_SAMPLING_DEFAULTS, **common)


@hookimpl
def armillary_register_parsers(registry) -> None:
    registry.register("qwen3", "reasoning", f"{_PKG}.parsers.reasoning:Qwen3ReasoningParser")


@hookimpl
def armillary_register_kernels(registry) -> None:
    tuned = [(9, 0), (12, 1)]  # tuning/sm_90.json measured on an H200; sm_121 untuned guesses
    ops = f"{_PKG}.ops"
    registry.register("torch_gated_delta_rule", "gated_delta_rule",
                      f"{ops}.gated_delta_rule.naive:chunk_gated_delta_rule_ref", kind="reference")
    registry.register("triton_gdn_decode", "gated_delta_rule",
                      f"{ops}.gated_delta_rule.fused_recurrent:fused_gdn_decode", targets=tuned)
    registry.register("triton_chunk_gated_delta_rule", "gated_delta_rule",
                      f"{ops}.gated_delta_rule.chunk:chunk_gated_delta_rule", targets=tuned)
