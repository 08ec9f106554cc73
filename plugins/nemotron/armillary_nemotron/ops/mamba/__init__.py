"""Mamba-2 kernels: the SSD chunked scan (prefill), the fused decode and verify steps, and their naive references."""
