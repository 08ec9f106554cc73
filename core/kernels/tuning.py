"""Kernel launch configs (block sizes, warps, stages) per GPU, from stacked tables: plugin over core over defaults.

A package keeps JSON tables in its ``tuning`` folder, one per GPU target: ``sm_90.json`` for a
compute capability (H100 and H200) and optionally ``sm_90_h200.json`` / ``sm_90_h100.json`` for one
GPU of it: ``{"kernel_name": {"<shape key>": {"BLOCK_K": 64, "num_warps": 4}}}``, ``"default"``
applying to every shape. A missing file or entry falls through to the next layer.

``kernel_config(package, kernel, key, defaults)`` starts from the kernel's ``defaults`` and
overlays, lowest first: ``package``'s capability table, its GPU table, then the same two of each
active overlay package (the served architecture's plugin, set through ``ops.install``), each
table's ``"default"`` entry before its ``key`` entry. So a plugin's table carries its models'
shapes, core's the generic entries, and a GPU's own table what differs from its capability's.
``ARMILLARY_TUNING`` (a JSON object shaped like a table, read at import) lies over all of them, for A/B runs
of one table decision through the real engine (``bench/env_ab.py``).
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from importlib import resources

import torch

_overlay: tuple[str, ...] = ()  # packages whose tables lie over the kernel's own, lowest first


def parse_env_table(text: str) -> dict:
    """``ARMILLARY_TUNING``'s table: ``{"kernel": {"default" or key: {...}}}``; {} when empty."""
    if not text.strip():
        return {}
    try:
        table = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"ARMILLARY_TUNING is not JSON ({e}): {text!r}") from None
    if not isinstance(table, dict) or not all(
            isinstance(entries, dict) and all(isinstance(v, dict) for v in entries.values())
            for entries in table.values()):
        raise ValueError(f'ARMILLARY_TUNING must look like a table, {{"kernel": {{"key": {{...}}}}}}: {text!r}')
    return table


_env_table: dict = parse_env_table(os.environ.get("ARMILLARY_TUNING", ""))
_architecture: str | None = None  # the served architecture's registry name: a key for per-model entries


def use_packages(packages: tuple[str, ...] | list[str]) -> None:
    """Set the process's overlay packages (``ops.install`` does, from the dispatch table)."""
    global _overlay
    _overlay = tuple(packages)


def active_packages() -> tuple[str, ...]:
    return _overlay


def use_architecture(name: str | None) -> None:
    """Set the served architecture (``ops.install`` does): entries keyed per model, such as ``pdl``, use it."""
    global _architecture
    _architecture = name


def active_architecture() -> str | None:
    return _architecture


@contextmanager
def overlay(*packages: str) -> Iterator[None]:
    """Overlay ``packages``' tables for the duration (benchmarks and tests calling kernels directly)."""
    saved = _overlay
    use_packages(packages)
    try:
        yield
    finally:
        use_packages(saved)


@lru_cache(maxsize=None)
def _capability(index: int | None) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm_{major}{minor}"


def device_target(device: torch.device | None = None) -> str:
    """``"sm_90"`` for compute capability (9, 0); ``"cpu"`` without CUDA."""
    if device is not None and device.type != "cuda" or not torch.cuda.is_available():
        return "cpu"
    return _capability(device.index if device is not None else torch.cuda.current_device())


def gpu_name_key(name: str) -> str:
    """"NVIDIA H200" -> "h200", "NVIDIA H100 80GB HBM3" -> "h100", "NVIDIA GeForce RTX 4090" -> "rtx4090":
    the words up to the first with a digit, without the vendor and brand words."""
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w and w not in ("nvidia", "geforce", "tesla")]
    kept = []
    for word in words:
        kept.append(word)
        if any(c.isdigit() for c in word):
            break
    return "".join(kept)


@lru_cache(maxsize=None)
def _gpu_name(index: int) -> str:
    return gpu_name_key(torch.cuda.get_device_name(index))


def gpu_name(device: torch.device | None = None) -> str | None:
    """The GPU's table-name key (``"h200"``), or None off CUDA."""
    if device is not None and device.type != "cuda" or not torch.cuda.is_available():
        return None
    return _gpu_name(device.index if device is not None and device.index is not None else torch.cuda.current_device())


def device_targets(device: torch.device | None = None) -> tuple[str, ...]:
    """Table names for ``device``, least specific first: ``("sm_90", "sm_90_h200")``; ``("cpu",)`` off CUDA."""
    target = device_target(device)
    name = gpu_name(device) if target != "cpu" else None
    return (target, f"{target}_{name}") if name else (target,)


@lru_cache(maxsize=None)
def load_table(package: str, target: str) -> dict:
    """The tuning table of ``package`` (a ``tuning`` folder inside it) for ``target``; {} if none."""
    try:
        text = resources.files(package).joinpath("tuning", f"{target}.json").read_text()
    except (FileNotFoundError, ModuleNotFoundError, NotADirectoryError):
        return {}
    return json.loads(text)


_CONFIGS: dict[tuple, tuple] = {}  # kernel_config's answers: an eager prefill asks ~420 times, for a few keys
_CONFIGS_KEPT = 4096


def kernel_config(package: str, kernel: str, key: str, defaults: dict, device: torch.device | None = None) -> dict:
    """``defaults`` overlaid with each table's entry for ``kernel`` ("default", then ``key``), lowest table
    first: ``package``'s, then the overlay packages'; within a package the capability's, then the GPU's.

    Answers are remembered per explicit device and overlay (and per the defaults and the lookup functions
    in use, so a test that swaps one sees a fresh answer); each call gets its own copy."""
    if device is None:
        return _kernel_config(package, kernel, key, defaults, device)
    memo = (package, kernel, key, device, _overlay)
    hit = _CONFIGS.get(memo)
    # a hit must come from the same defaults and lookups: compared, not hashed (the cheap part of a launch)
    if hit is not None and hit[1] is load_table and hit[2] is device_targets and hit[3] is device_target \
            and hit[4] is gpu_name and hit[0] == defaults:
        cfg, nested = hit[5], hit[6]
        return _copy(cfg) if nested else dict(cfg)
    cfg = _kernel_config(package, kernel, key, defaults, device)
    if len(_CONFIGS) >= _CONFIGS_KEPT:
        _CONFIGS.clear()
    nested = any(isinstance(v, dict) for v in cfg.values())  # a hit copies nested entries only when there are any
    # the defaults as they were, so a later edit of them in place is noticed
    _CONFIGS[memo] = (_copy(defaults), load_table, device_targets, device_target, gpu_name, _copy(cfg), nested)
    return cfg


def _copy(entries: dict) -> dict:
    """A copy of a config whose nested dicts (per-batch overrides) are copied too."""
    return {k: dict(v) if isinstance(v, dict) else v for k, v in entries.items()}


def _kernel_config(package: str, kernel: str, key: str, defaults: dict, device: torch.device | None) -> dict:
    cfg = dict(defaults)
    targets = device_targets(device)
    layers = [load_table(pkg, target) for pkg in _packages(package) for target in targets]
    for table in (*layers, _env_table):
        entries = table.get(kernel)
        if entries:
            cfg.update(entries.get("default", ()))
            cfg.update(entries.get(key, ()))
    return cfg


def use_env_table(text: str) -> None:
    """Replace ``ARMILLARY_TUNING``'s table for this process (tests); forgets remembered answers."""
    global _env_table
    _env_table = parse_env_table(text)
    _CONFIGS.clear()


def table_layers(package: str, device: torch.device | None = None) -> list[tuple[str, str]]:
    """(package, table name) of every table ``kernel_config`` reads for ``package``'s kernels, lowest first."""
    return [(pkg, target) for pkg in _packages(package) for target in device_targets(device)]


def _packages(package: str) -> tuple[str, ...]:
    return (package, *(p for p in _overlay if p != package))
