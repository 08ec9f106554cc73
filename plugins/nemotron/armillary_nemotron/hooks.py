"""Entry point of the nemotron plugin (``[project.entry-points.armillary] nemotron = "armillary_nemotron.hooks"``)."""
from __future__ import annotations

from armillary.hookspecs import hookimpl

_PKG = "armillary_nemotron"


@hookimpl
def armillary_register_architectures(registry) -> None:
    registry.register("nemotron_h", ["NemotronHForCausalLM"], f"{_PKG}.model:NemotronHForCausalLM",
                      description="Nemotron-H / Nemotron-3 Nano: Mamba-2 + attention + relu² MoE",
                      default_reasoning_parser="nano_v3",
                      default_tool_parser="qwen3_coder")  # the template writes qwen3_coder XML calls (core's)


@hookimpl
def armillary_register_parsers(registry) -> None:
    registry.register("nano_v3", "reasoning", f"{_PKG}.parsers.reasoning:NanoV3ReasoningParser")


@hookimpl
def armillary_register_kernels(registry) -> None:
    tuned = [(9, 0), (12, 1)]  # tuning/sm_90.json and sm_121.json: first guesses, not yet swept on the GPU
    mamba = f"{_PKG}.ops.mamba"
    registry.register("torch_mamba_ssd_scan", "mamba_ssd_scan", f"{mamba}.naive:ssd_chunk_scan_ref", kind="reference")
    registry.register("triton_mamba_ssd_scan", "mamba_ssd_scan", f"{mamba}.ssd_scan:ssd_chunk_scan", targets=tuned)
    registry.register("torch_mamba_decode", "mamba_decode", f"{mamba}.naive:selective_state_update_ref",
                      kind="reference")
    registry.register("triton_mamba_decode", "mamba_decode", f"{mamba}.decode:mamba_decode_step", targets=tuned)
