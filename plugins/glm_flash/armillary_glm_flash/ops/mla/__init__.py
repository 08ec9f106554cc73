"""Multi-head latent attention over the paged latent cache: absorbed decode (Triton + reference), decompressed prefill."""
from __future__ import annotations

from armillary_glm_flash.ops.mla.naive import (
    absorb_query,
    expand_values,
    gather_latent,
    mla_decode_ref,
    mla_decompressed_ref,
    write_latent,
)

__all__ = ["absorb_query", "expand_values", "gather_latent", "mla_decode_ref", "mla_decompressed_ref", "write_latent"]
