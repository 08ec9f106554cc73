"""Programmatic dependent launch (sm_90+): a kernel launched with it may start while the kernel before
it is still running, and must ``gdc_wait`` before reading anything that kernel (or an earlier one) wrote.

Decode steps are chains of ~350 small kernels; overlapping each launch with its predecessor's tail
hides most of the per-launch latency inside the CUDA graph. Kernels opt in with a ``PDL`` constexpr:
``pdl_prologue`` at their top (let the next kernel launch early, then wait for the previous one),
and their wrappers pass ``**launch_options(device)``. ``ARMILLARY_PDL=0`` turns it off.
"""
from __future__ import annotations

import os
from functools import lru_cache

import torch
import triton
import triton.language as tl

try:  # Triton >= 3.3
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: PDL stays off
    gdc_launch_dependents = gdc_wait = None


@lru_cache(maxsize=None)
def _supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """On a CUDA device of compute capability 9+, with a Triton that has the intrinsics, unless disabled."""
    if device.type != "cuda" or gdc_wait is None or os.environ.get("ARMILLARY_PDL", "1") == "0":
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())


def launch_options(device: torch.device) -> dict:
    """Extra launch keywords for a kernel with a ``PDL`` constexpr: ``PDL`` itself and ``launch_pdl``."""
    on = pdl_enabled(device)
    return {"PDL": on, "launch_pdl": True} if on else {"PDL": False}


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    """First statement of a PDL kernel: the next kernel may launch now; then wait for the previous one."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
