"""Entry point of the glm_flash plugin (``[project.entry-points.armillary] glm_flash = "armillary_glm_flash.hooks"``)."""
from __future__ import annotations

from armillary.hookspecs import hookimpl

_PKG = "armillary_glm_flash"


@hookimpl
def armillary_register_architectures(registry) -> None:
    registry.register("glm4_moe_lite", ["Glm4MoeLiteForCausalLM"], f"{_PKG}.model:Glm4MoeLiteForCausalLM",
                      description="GLM-4.7-Flash: MLA + sigmoid-routed MoE + MTP",
                      default_tool_parser="glm47", default_reasoning_parser="glm45")


@hookimpl
def armillary_register_parsers(registry) -> None:
    registry.register("glm45", "reasoning", f"{_PKG}.parsers.reasoning:Glm45ReasoningParser")
    registry.register("glm47", "tool", f"{_PKG}.parsers.glm47:Glm47ToolParser")


@hookimpl
def armillary_register_kernels(registry) -> None:
    tuned = [(9, 0)]  # tuning/sm_90.json: defaults until bench/glm_flash_gpu_checks.py --sweep measures them
    ops = f"{_PKG}.ops.mla"
    registry.register("torch_mla_decode", "mla_decode", f"{ops}.naive:mla_decode_ref", kind="reference")
    registry.register("triton_mla_decode", "mla_decode", f"{ops}.decode:mla_decode", targets=tuned)
