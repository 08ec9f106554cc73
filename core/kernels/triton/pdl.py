"""Programmatic dependent launch (sm_90+): a kernel launched with it may start while the kernel before
it is still running, and must ``gdc_wait`` before reading anything that kernel (or an earlier one) wrote.

Decode steps are chains of ~350 small kernels; overlapping each launch with its predecessor's tail
hides most of the per-launch latency inside the CUDA graph. Kernels opt in with a ``PDL`` constexpr:
``pdl_prologue`` at their top (let the next kernel launch early, then wait for the previous one),
and their wrappers pass ``**launch_options(device)``. Whether it pays depends on the model's kernel chain
(GLM-4.7-Flash decode gains 5%, Gemma 4 loses 7%), so the tuning tables decide per served architecture
(``"pdl": {"gemma4": {"enabled": false}}`` in a plugin's table, keyed by the registry name, or ``"default"``
for all its models); ``ARMILLARY_PDL=0`` / ``=1`` overrides them.
"""
from __future__ import annotations

import os
from functools import lru_cache

import torch
import triton
import triton.language as tl

from armillary.kernels import tuning
from armillary.kernels.tuning import active_architecture, kernel_config

try:  # Triton >= 3.3
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: PDL stays off
    gdc_launch_dependents = gdc_wait = None


@lru_cache(maxsize=None)
def _supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_override(value: str | None = None) -> bool | None:
    """``ARMILLARY_PDL`` (or ``value``): "0" forces PDL off, "1" on (where the GPU has it); unset, the tables decide."""
    value = os.environ.get("ARMILLARY_PDL", "") if value is None else value
    if value not in ("", "0", "1"):
        raise ValueError(f"ARMILLARY_PDL must be 0 or 1, not {value!r}")
    return None if value == "" else value == "1"


def pdl_available(device: torch.device) -> bool:
    """A CUDA device of compute capability 9+ and a Triton that has the intrinsics."""
    if device.type != "cuda" or gdc_wait is None:
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())


_DECIDED: dict[tuple, bool] = {}  # every launch asks (an eager prefill ~1,400 times): one answer per setting


def pdl_enabled(device: torch.device) -> bool:
    """Available, and asked for by ``ARMILLARY_PDL`` or else the tables' ``pdl`` entry (default on)."""
    env = os.environ.get("ARMILLARY_PDL", "")
    key = (device, env, active_architecture(), tuning.active_packages(), tuning.load_table, pdl_available)
    decided = _DECIDED.get(key)
    if decided is None:
        decided = _DECIDED[key] = _decide(device, env)
    return decided


def _decide(device: torch.device, env: str) -> bool:
    if not pdl_available(device):
        return False
    forced = pdl_override(env)
    if forced is not None:
        return forced
    table_key = active_architecture() or "default"
    return bool(kernel_config("armillary.kernels", "pdl", table_key, {"enabled": True}, device)["enabled"])


_ON, _OFF = {"PDL": True, "launch_pdl": True}, {"PDL": False}


def launch_options(device: torch.device) -> dict:
    """Extra launch keywords for a kernel with a ``PDL`` constexpr: ``PDL`` itself and ``launch_pdl``.

    One shared dict per answer: callers unpack it (``**launch_options(device)``), never change it."""
    return _ON if pdl_enabled(device) else _OFF


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    """First statement of a PDL kernel: the next kernel may launch now; then wait for the previous one."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
