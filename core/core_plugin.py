"""Core's own defaults, registered through the same hooks as any plugin."""
from __future__ import annotations

from armillary.hookspecs import hookimpl

_TUNED = [(9, 0), (12, 1)]  # tables in core/kernels/tuning: sm_90 measured, sm_121 untuned guesses


@hookimpl
def armillary_register_kernels(registry) -> None:
    registry.register("torch_paged_attention", "paged_attention", "armillary.kernels.attention:paged_attention")
    registry.register("torch_rms_norm", "rms_norm", "armillary.kernels.norm:rms_norm")
    registry.register("torch_rotary", "rotary_embedding", "armillary.kernels.rotary:apply_rotary")
    registry.register("torch_fused_moe", "fused_moe", "armillary.kernels.moe:fused_moe")
    registry.register("torch_linear", "linear", "torch.nn.functional:linear")
    registry.register("sdpa_fresh_prefill", "paged_attention", "armillary.kernels.sdpa_prefill:fresh_prefill_attention")
    tri = "armillary.kernels.triton"
    registry.register("triton_paged_attention_decode", "paged_attention",
                      f"{tri}.paged_attention:paged_attention_decode", targets=_TUNED)
    registry.register("triton_paged_attention_prefill", "paged_attention",
                      f"{tri}.paged_attention:paged_attention_prefill", targets=_TUNED)
    registry.register("triton_rms_norm", "rms_norm", f"{tri}.norm:rms_norm", targets=_TUNED)
    registry.register("triton_rotary", "rotary_embedding", f"{tri}.rotary:apply_rotary_", targets=_TUNED)
    registry.register("triton_fused_moe", "fused_moe", f"{tri}.moe:fused_moe", targets=_TUNED)
    registry.register("triton_moe_gemv", "fused_moe", f"{tri}.moe_gemv:moe_gemv", targets=_TUNED)
    registry.register("triton_skinny_gemm", "linear", f"{tri}.skinny_gemm:skinny_gemm", targets=_TUNED)
    registry.register("triton_qk_norm_rope_store", "qk_norm_rope_store", f"{tri}.qk_norm_rope:qk_norm_rope_store",
                      targets=_TUNED)
