"""Mamba-2 kernels: the SSD chunked scan (prefill), the fused decode step, and their naive references."""
