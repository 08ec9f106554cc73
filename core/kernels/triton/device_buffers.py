"""Scratch buffers kernels keep between launches, one per (name, device), CUDA-graph safe.

``ticket_buffer`` holds the int32 counters of "last program to arrive" reductions (split-K
GEMMs, the GDN decode step): zeros between launches, since every kernel resets the counters it
used. Buffers grow by doubling outside a CUDA-graph capture; the replaced one stays alive for the
graphs captured with it. A capture that needs more gets a buffer of its own (zero-filled inside
the graph, so on every replay) and leaves the cache as it was; the engine's eager warm-up of
every graph size makes that a fallback.
"""
from __future__ import annotations

import torch

_BUFFERS: dict[tuple[str, torch.device], torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # replaced buffers that captured graphs may still point at
MIN_TICKETS = 4096


def _canonical(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:0" are one entry
        return torch.device("cuda", torch.cuda.current_device())
    return device


def device_buffer(name: str, device: torch.device, numel: int, dtype: torch.dtype, zeroed: bool) -> torch.Tensor:
    """At least ``numel`` elements of ``dtype`` on ``device`` (zeros when made, if ``zeroed``)."""
    key = (name, _canonical(device))
    have = _BUFFERS.get(key)
    if have is not None and have.numel() >= numel:
        return have
    size = max(numel, 2 * have.numel() if have is not None else 0)
    made = torch.zeros(size, dtype=dtype, device=device) if zeroed else torch.empty(size, dtype=dtype, device=device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return made
    if have is not None:
        _RETIRED.append(have)
    _BUFFERS[key] = made
    return made


def ticket_buffer(device: torch.device, size: int) -> torch.Tensor:
    """The device's int32 ticket counters, at least ``size`` of them, all zero between launches."""
    return device_buffer("tickets", device, max(size, MIN_TICKETS), torch.int32, zeroed=True)
