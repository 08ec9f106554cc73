"""Entry point of the gemma plugin (``[project.entry-points.armillary] gemma = "armillary_gemma.hooks"``).

Hooks only name classes as ``"module:Class"`` strings; armillary imports them when a model needs them.
"""
from __future__ import annotations

from armillary.hookspecs import hookimpl

_PKG = "armillary_gemma"


@hookimpl
def armillary_register_architectures(registry) -> None:
    # Gemma 3 has no native tool format: plain chat, and forced tool calls through core's grammar
    registry.register("gemma3", ["Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"],
                      f"{_PKG}.model:Gemma3ForCausalLM",
                      description="Gemma 3 text (1B-27B; multimodal checkpoints text-only): sliding + global attention")
    registry.register("gemma4", ["Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"],
                      f"{_PKG}.model:Gemma4ForCausalLM", default_tool_parser="gemma4",
                      default_reasoning_parser="gemma4_thinking",
                      description="Gemma 4 text (31B, 26B-A4B MoE, E2B / E4B): sliding + global attention")


@hookimpl
def armillary_register_parsers(registry) -> None:
    registry.register("gemma4_thinking", "reasoning", f"{_PKG}.parsers.reasoning:Gemma4ReasoningParser")
    registry.register("gemma4", "tool", f"{_PKG}.parsers.gemma4_tool:Gemma4ToolParser")


@hookimpl
def armillary_register_kernels(registry) -> None:
    tuned = [(9, 0), (12, 1)]  # tuning/sm_90.json and sm_121.json: launch-config guesses, not yet swept
    registry.register("torch_gelu_tanh_and_mul", "gelu_tanh_and_mul", f"{_PKG}.ops.naive:gelu_tanh_and_mul_ref",
                      kind="reference")
    registry.register("triton_gelu_tanh_and_mul", "gelu_tanh_and_mul", f"{_PKG}.ops.geglu:gelu_tanh_and_mul",
                      targets=tuned)
    registry.register("torch_norm_add_norm", "norm_add_norm", f"{_PKG}.ops.naive:norm_add_norm_ref", kind="reference")
    registry.register("triton_norm_add_norm", "norm_add_norm", f"{_PKG}.ops.norm:norm_add_norm_triton", targets=tuned)
    # Gemma 4's fused decode launches; the layers call them directly (``ops.use_triton``), listed here with
    # their references so the dispatch description shows them
    for interface, fn, ref in (("gemma4_attn_out_norms", "layer_norms:attn_out_norms_triton", "attn_out_norms_ref"),
                               ("gemma4_layer_tail", "layer_norms:layer_tail_triton", "layer_tail_ref"),
                               ("gemma4_route", "router:gemma4_route_triton", "gemma4_route_ref"),
                               ("gemma4_qkv_norm_rope_store", "qkv_rope:qkv_norm_rope_store_triton",
                                "gemma4_qkv_norm_rope_ref"),
                               ("gemma_softcap", "softcap:softcap_triton", "softcap_ref"),
                               ("gemma_gemv", "gemv:gemma_gemv", "gemma_gemv_ref")):
        registry.register(f"torch_{interface}", interface, f"{_PKG}.ops.naive:{ref}", kind="reference")
        registry.register(f"triton_{interface}", interface, f"{_PKG}.ops.{fn}", targets=tuned)
