"""Core's own defaults, registered through the same hooks as any plugin."""
from __future__ import annotations

from armillary.hookspecs import hookimpl


@hookimpl
def armillary_register_kernels(registry) -> None:
    registry.register("torch_paged_attention", "paged_attention", "armillary.kernels.attention:paged_attention")
    registry.register("torch_rms_norm", "rms_norm", "armillary.kernels.norm:rms_norm")
    registry.register("torch_rotary", "rotary_embedding", "armillary.kernels.rotary:apply_rotary")
