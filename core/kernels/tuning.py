"""Per-compute-capability kernel configs (block sizes, warps, stages), chosen at start-up.

A package keeps one JSON file per GPU target, e.g. ``tuning/sm_90.json`` (H100 / H200) and
``tuning/sm_121.json`` (GB10): ``{"kernel_name": {"<shape key>": {"BLOCK_K": 64, "num_warps": 4}}}``.
``"default"`` is the key used when a shape has no entry. A missing file means the kernel's own
defaults; an autotune script regenerates a file on a new GPU.
"""
from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources

import torch


def device_target(device: torch.device | None = None) -> str:
    """``"sm_90"`` for compute capability (9, 0); ``"cpu"`` without CUDA."""
    if device is not None and device.type != "cuda" or not torch.cuda.is_available():
        return "cpu"
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


@lru_cache(maxsize=None)
def load_table(package: str, target: str) -> dict:
    """The tuning table of ``package`` (a ``tuning`` folder inside it) for ``target``; {} if none."""
    try:
        text = resources.files(package).joinpath("tuning", f"{target}.json").read_text()
    except (FileNotFoundError, ModuleNotFoundError, NotADirectoryError):
        return {}
    return json.loads(text)


def kernel_config(package: str, kernel: str, key: str, defaults: dict, device: torch.device | None = None) -> dict:
    """``defaults`` overlaid with the table entry for ``kernel`` at shape ``key`` (or its "default")."""
    entries = load_table(package, device_target(device)).get(kernel, {})
    return {**defaults, **entries.get("default", {}), **entries.get(key, {})}
