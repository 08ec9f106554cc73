"""Core's own defaults, registered through the same hooks as any plugin."""
from __future__ import annotations

from armillary.hookspecs import hookimpl

_TUNED = [(9, 0), (12, 1)]  # tables in core/kernels/tuning: sm_90 measured, sm_121 untuned guesses
_REF = "armillary.kernels.reference"
_TRI = "armillary.kernels.triton.impls"

# interface -> its plain-torch reference (the oracle, the CPU path, the last fallback on a GPU)
_REFERENCES = {
    "linear": ("torch_linear", "torch.nn.functional:linear"),
    "store_kv": ("torch_store_kv", f"{_REF}:store_kv"),
    "paged_attention_decode": ("torch_paged_attention_decode", f"{_REF}:paged_attention"),
    "paged_attention_prefill": ("torch_paged_attention_prefill", f"{_REF}:paged_attention"),
    "qk_norm_rope_store": ("torch_qk_norm_rope_store", f"{_REF}:qk_norm_rope_store"),
    "rms_norm": ("torch_rms_norm", "armillary.kernels.norm:rms_norm"),
    "add_rms_norm": ("torch_add_rms_norm", f"{_REF}:add_rms_norm"),
    "gated_rms_norm": ("torch_gated_rms_norm", "armillary.kernels.norm:gated_rms_norm"),
    "rotary": ("torch_rotary", "armillary.kernels.rotary:apply_rotary"),
    "softmax_topk": ("torch_softmax_topk", f"{_REF}:softmax_topk"),
    "sigmoid_topk": ("torch_sigmoid_topk", f"{_REF}:sigmoid_topk"),
    "fused_moe": ("torch_fused_moe", "armillary.kernels.moe:fused_moe"),
    "causal_conv1d": ("torch_causal_conv1d", f"{_REF}:causal_conv1d"),
    "fp8_linear": ("torch_fp8_linear", "armillary.kernels.fp8:linear"),
    "fp8_fused_moe": ("torch_fp8_fused_moe", "armillary.kernels.fp8:fused_moe"),
    "fp4_linear": ("torch_fp4_linear", "armillary.kernels.fp4:linear"),
    "fp4_fused_moe": ("torch_fp4_fused_moe", "armillary.kernels.fp4:fused_moe"),
}
# interface -> core's Triton implementation, in the interface's signature (kernels/triton/impls.py)
_TRITON = {
    "linear": ("triton_skinny_gemm", "linear"),
    "store_kv": ("triton_store_kv", "store_kv"),
    "paged_attention_decode": ("triton_paged_attention_decode", "paged_attention_decode"),
    "paged_attention_prefill": ("triton_paged_attention_prefill", "paged_attention_prefill"),
    "qk_norm_rope_store": ("triton_qk_norm_rope_store", "qk_norm_rope_store"),
    "rms_norm": ("triton_rms_norm", "rms_norm"),
    "add_rms_norm": ("triton_add_rms_norm", "add_rms_norm"),
    "gated_rms_norm": ("triton_gated_rms_norm", "gated_rms_norm"),
    "rotary": ("triton_rotary", "rotary"),
    "softmax_topk": ("triton_softmax_topk", "softmax_topk"),
    "sigmoid_topk": ("triton_sigmoid_topk", "sigmoid_topk"),
    "fused_moe": ("triton_fused_moe", "fused_moe"),
    "causal_conv1d": ("triton_causal_conv1d", "causal_conv1d"),
    "fp8_linear": ("triton_fp8_linear", "fp8_linear"),
    "fp8_fused_moe": ("triton_fp8_fused_moe", "fp8_fused_moe"),
    "fp4_linear": ("triton_fp4_linear", "fp4_linear"),
    "fp4_fused_moe": ("triton_fp4_fused_moe", "fp4_fused_moe"),
}
_SUPPORTS = {"linear": f"{_TRI}:supports_linear"}  # per-call checks: the skinny GEMM takes decode-sized rows


@hookimpl
def armillary_register_kernels(registry) -> None:
    for interface, (name, impl) in _REFERENCES.items():
        registry.register(name, interface, impl, kind="reference")
    for interface, (name, fn) in _TRITON.items():
        registry.register(name, interface, f"{_TRI}:{fn}", targets=_TUNED, priority=10,
                          supports=_SUPPORTS.get(interface))
    # native FP4 MMA (W4A4 prefill) where the capability has it; ahead of the Hopper kernels there
    registry.register("triton_fp4_linear_blackwell", "fp4_linear", f"{_TRI}:fp4_linear_blackwell",
                      targets=[(10, 0), (12, 0), (12, 1)], priority=20,
                      supports="armillary.kernels.triton.fp4_blackwell:supports")
    registry.register("sdpa_fresh_prefill", "fresh_prefill_attention", "armillary.kernels.sdpa_prefill:fresh_prefill",
                      supports="armillary.kernels.sdpa_prefill:supports", kind="native")


@hookimpl
def armillary_register_quantizations(registry) -> None:
    registry.register("unquantized", "armillary.layers.quantization.unquantized:UnquantizedConfig",
                      description="bf16 / fp16 / fp32 weights as stored")
    registry.register("fp8", "armillary.layers.quantization.fp8:Fp8Config",
                      description="FP8 e4m3 block-wise weights (weight_scale_inv), dynamic activations; online fp8")
    registry.register("compressed-tensors", "armillary.layers.quantization.compressed_tensors:CompressedTensorsConfig",
                      description="compressed-tensors FP8 (per-channel or block weight_scale, dynamic activations) "
                                  "and NVFP4 (nvfp4-pack-quantized)")
    registry.register("modelopt", "armillary.layers.quantization.modelopt:ModelOptConfig",
                      description="NVIDIA ModelOpt NVFP4 / W4A16_NVFP4, per-tensor FP8, MIXED_PRECISION of both")


@hookimpl
def armillary_register_parsers(registry) -> None:
    registry.register("hermes", "tool", "armillary.parsers.json_tools:HermesToolParser")
    registry.register("llama3_json", "tool", "armillary.parsers.json_tools:Llama3JsonToolParser")
    # several families' templates write this XML format (Qwen3.5 / 3.6, Qwen3-Coder, Nemotron-3 Nano)
    registry.register("qwen3_coder", "tool", "armillary.parsers.qwen3_coder:Qwen3CoderToolParser")
