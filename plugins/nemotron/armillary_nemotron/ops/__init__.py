"""Mamba-2 and other Nemotron-H kernels, each beside its naive fp32 reference."""
