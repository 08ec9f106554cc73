"""armillary plugin for Qwen3-Next and Qwen3.5 / Qwen3.6 (Gated DeltaNet + gated attention + MoE)."""
