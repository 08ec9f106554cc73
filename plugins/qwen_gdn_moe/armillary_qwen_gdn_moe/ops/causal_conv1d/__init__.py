"""Depthwise causal conv1d with per-slot window state, in Triton: ``varlen.causal_conv1d_prefill``
(packed varlen prefill). Import the module where the GPU path needs it; this package defines no
kernels on import (under TRITON_INTERPRET the mode is fixed when a kernel is defined)."""
