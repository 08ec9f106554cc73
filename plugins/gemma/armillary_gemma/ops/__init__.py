"""Gemma's own Triton kernels (where Gemma differs from what core ships), each beside its fp32 reference."""
