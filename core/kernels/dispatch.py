"""Kernel dispatch: the registered implementations of each interface, resolved once per engine and device.

``resolve_dispatch(registry, arch_name, device, backend)`` keeps, per interface, the
implementations that apply to the architecture (``architectures`` empty or naming it) and run on
the device under the backend, best first:

* backend "reference": the references only; "auto": on CUDA every kind, elsewhere references and
  native code (no Triton); "triton": every kind, Triton first (the interpreter off CUDA);
* an implementation whose ``supports(device, None)`` is False is left out;
* references rank last; before them, implementations tuned for this GPU's capability (``targets``
  listing it, or empty) before untuned ones, an architecture's own override before generic
  ones, then higher ``priority``, then registration order.

A call takes the first candidate whose ``supports`` (if any) accepts the call's device, dtype and
shape facts (``interfaces.SHAPE_INFO``); an interface in ``interfaces.DECLINES`` moves on when an
implementation returns None. Where the first candidate has no ``supports`` the table holds the
function itself, so a call costs one dict lookup. ``ops.install(table)`` makes a table the
process's; ``table.tuning_packages`` (the architecture's plugin package) then overlay core's
tuning tables (``armillary.kernels.tuning``).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

import torch

from armillary.errors import PluginError
from armillary.kernels.interfaces import DECLINES, INTERFACES, shape_info

BACKENDS = ("auto", "reference", "triton")


@dataclass(slots=True)
class Candidate:
    """One implementation in an interface's order: its record, its function and its per-call check."""

    spec: Any  # armillary.registry.KernelSpec
    fn: Callable
    check: Callable | None
    tuned: bool  # its targets list this GPU's capability (or it has none)

    def label(self) -> str:
        notes = [self.spec.plugin or "?"] + ([] if self.tuned else ["untuned"])
        return f"{self.spec.name} ({', '.join(notes)})"


class DispatchTable:
    """Per interface the candidates, best first, and the callable ``ops`` goes through (``calls``)."""

    def __init__(self, arch_name: str | None, device: torch.device, backend: str,
                 capability: tuple[int, int] | None, gpu: str | None, chains: dict[str, list[Candidate]],
                 tuning_packages: tuple[str, ...]) -> None:
        self.arch_name = arch_name
        self.device = device
        self.backend = backend
        self.capability = capability
        self.gpu = gpu
        self.chains = chains
        self.tuning_packages = tuning_packages
        self.triton = backend == "triton" or (backend == "auto" and device.type == "cuda")
        tuned_only = backend != "triton"
        self.calls: dict[str, Callable] = {name: _dispatcher(name, chain, tuned_only, device, backend)
                                           for name, chain in chains.items()}
        for name in INTERFACES:
            self.calls.setdefault(name, _dispatcher(name, [], tuned_only, device, backend))

    def chain(self, interface: str) -> list[Candidate]:
        return self.chains.get(interface, [])

    def chosen(self, interface: str) -> str | None:
        """The name of the first candidate of ``interface``, or None when it has none."""
        chain = self.chain(interface)
        return chain[0].spec.name if chain else None

    def header(self) -> str:
        target = f"sm_{self.capability[0]}{self.capability[1]}" if self.capability else self.device.type
        gpu = f" {self.gpu}" if self.gpu else ""
        tables = " over ".join((*reversed(self.tuning_packages), "core"))
        return (f"{self.arch_name or 'any architecture'} on {self.device} ({target}{gpu}), backend {self.backend}, "
                f"tuning tables {tables}")

    def describe(self) -> list[str]:
        """One line per interface: ``"interface: chosen (plugin) then fallback (plugin), ..."``."""
        names = [*INTERFACES, *(n for n in self.chains if n not in INTERFACES)]
        lines = []
        for name in names:
            chain = self.chain(name)
            if not chain:
                lines.append(f"{name}: none")
                continue
            rest = f" then {', '.join(c.label() for c in chain[1:])}" if len(chain) > 1 else ""
            lines.append(f"{name}: {chain[0].label()}{rest}")
        return lines


def _declined(*args: Any) -> None:
    return None


def _missing(interface: str, device: torch.device, backend: str) -> Callable:
    def call(*args: Any) -> Any:
        raise PluginError(f"no implementation of kernel interface {interface!r} on {device} (backend {backend})")

    return call


def _dispatcher(interface: str, chain: list[Candidate], tuned_only: bool, device: torch.device,
                backend: str) -> Callable:
    declines = interface in DECLINES
    if not chain:
        return _declined if declines else _missing(interface, device, backend)
    if chain[0].check is None and not declines:
        return chain[0].fn
    info = shape_info(interface)
    steps = [(c.fn, c.check) for c in chain]

    def call(*args: Any) -> Any:
        device, dtype, shape = info(*args)
        for fn, check in steps:
            if check is not None and not check(device, dtype, tuned_only=tuned_only, **shape):
                continue
            out = fn(*args)
            if out is not None or not declines:
                return out
        if declines:
            return None
        raise PluginError(f"no implementation of kernel interface {interface!r} takes this call on {device}")

    return call


def _eligible(kind: str, backend: str, device: torch.device) -> bool:
    if backend == "reference":
        return kind == "reference"
    if backend == "auto" and device.type != "cuda":
        return kind != "triton"
    return True


def tuning_packages_of(registry: Any, arch_name: str | None) -> tuple[str, ...]:
    """The architecture's plugin package (top level of its model class), whose ``tuning/`` tables overlay core's."""
    archs = getattr(registry, "architectures", None)
    if arch_name is None or archs is None or arch_name not in archs:
        return ()
    package = archs.get(arch_name).model_cls.partition(":")[0].split(".")[0]
    if package == "armillary":
        return ()
    try:
        has_tables = resources.files(package).joinpath("tuning").is_dir()
    except (ModuleNotFoundError, NotADirectoryError, TypeError):
        has_tables = False
    return (package,) if has_tables else ()


def resolve_dispatch(registry: Any, arch_name: str | None, device: torch.device | str, backend: str = "auto", *,
                     capability: tuple[int, int] | None = None, gpu: str | None = None) -> DispatchTable:
    """The dispatch table for ``arch_name`` on ``device``; ``registry``: a PluginRegistry (or its KernelRegistry).

    ``capability`` / ``gpu`` default to the device's own (CUDA only); tests pass them to resolve for a
    GPU they do not have. Imports the implementations (lazily named) but touches no CUDA otherwise.
    """
    if backend not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS}, not {backend!r}")
    device = torch.device(device)
    if device.type == "cuda" and capability is None:
        capability = tuple(torch.cuda.get_device_capability(device))
    if device.type == "cuda" and gpu is None and capability is not None and torch.cuda.is_available():
        from armillary.kernels.tuning import gpu_name

        gpu = gpu_name(device)
    kernels = getattr(registry, "kernels", registry)
    tuned_only = backend != "triton"
    chains: dict[str, list[Candidate]] = {}
    for interface in kernels.interfaces():
        ranked = []
        for order, spec in enumerate(kernels.for_interface(interface)):
            if spec.architectures and arch_name not in spec.architectures:
                continue
            if not _eligible(spec.kind, backend, device):
                continue
            check = spec.load_supports()
            if check is not None and not check(device, None, tuned_only=tuned_only):
                continue
            tuned = device.type != "cuda" or not spec.targets or tuple(capability or ()) in spec.targets
            key = (spec.kind == "reference", backend == "triton" and spec.kind != "triton", not tuned,
                   not spec.architectures, -spec.priority, order)
            ranked.append((key, Candidate(spec, spec.load(), check, tuned)))
        chains[interface] = [c for _, c in sorted(ranked, key=lambda item: item[0])]
    return DispatchTable(arch_name, device, backend, capability, gpu, chains, tuning_packages_of(registry, arch_name))


@lru_cache(maxsize=1)
def core_registry() -> Any:
    """Core's own registrations only: what ``ops`` dispatches through before an engine installs a table."""
    from armillary.registry import PluginRegistry

    return PluginRegistry()
