"""Plugin discovery and the registries that hooks fill.

``PluginRegistry`` owns one pluggy ``PluginManager``. Core's own defaults are registered as a
plugin like any other; installed plugins come from entry points in group ``armillary``. Records
are keyed by name and a duplicate name is an error naming both plugins.
"""
from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Generic, TypeVar

import pluggy

from armillary import hookspecs
from armillary.errors import PluginError

DISABLE_ENV = "ARMILLARY_DISABLE_PLUGINS"

log = logging.getLogger("armillary")


def import_object(path: str) -> Any:
    """Import ``"package.module:Attr"`` lazily."""
    module, _, attr = path.partition(":")
    if not attr:
        raise PluginError(f"lazy reference {path!r} must look like 'package.module:Name'")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass(slots=True)
class ArchSpec:
    """One model class and the ``config.json`` ``architectures`` names it serves."""

    name: str
    hf_architectures: tuple[str, ...]
    model_cls: str  # "package.module:Class"
    default_tool_parser: str | None = None
    default_reasoning_parser: str | None = None
    description: str = ""
    plugin: str = ""
    # the model card's sampling defaults by mode: "thinking", "non_thinking" (and "<mode>_tools"), each
    # {"temperature": ..., "top_p": ...}; a server applies them to knobs a request leaves unset
    sampling_defaults: dict = field(default_factory=dict)

    def load(self) -> type:
        return import_object(self.model_cls)


@dataclass(slots=True)
class ParserSpec:
    """A tool-call (``kind="tool"``) or reasoning (``kind="reasoning"``) parser."""

    name: str
    kind: str
    parser_cls: str
    plugin: str = ""

    def load(self) -> type:
        return import_object(self.parser_cls)


@dataclass(slots=True)
class KernelSpec:
    """A named implementation of a kernel interface (``armillary.kernels.interfaces``), e.g. ``rms_norm``.

    ``kind``: "reference" (plain torch: the oracle, the CPU path, the last fallback on a GPU),
    "triton" (runs on CUDA, or in the interpreter under the "triton" backend) or "native" (other
    device code, e.g. cuDNN SDPA: runs where ``supports`` says). ``supports``: lazy
    ``"pkg.mod:func"`` answering ``(device, dtype, **shape) -> bool`` (None: always).
    ``architectures``: () for every architecture, else an override for those arch names only.
    Dispatch order: ``armillary.kernels.dispatch``.
    """

    name: str
    interface: str
    impl: str
    targets: tuple[tuple[int, int], ...] = ()  # compute capabilities it is tuned for; () = any
    plugin: str = ""
    priority: int = 0  # higher first among implementations of one rank
    supports: str | None = None
    architectures: tuple[str, ...] = ()
    kind: str = "triton"

    def load(self) -> Any:
        return import_object(self.impl)

    def load_supports(self) -> Any:
        return import_object(self.supports) if self.supports else None


@dataclass(slots=True)
class FormatSpec:
    """A model file format and its ``armillary.model_source.ModelSource`` subclass."""

    name: str
    source_cls: str
    description: str = ""
    plugin: str = ""

    def load(self) -> type:
        return import_object(self.source_cls)


@dataclass(slots=True)
class QuantSpec:
    """A checkpoint quantization format: ``quantization_config.quant_method`` -> its ``QuantConfig``."""

    name: str  # the ``quant_method`` value of config.json, e.g. "fp8"
    config_cls: str  # "package.module:Class", an ``armillary.layers.quantization.QuantConfig`` subclass
    description: str = ""
    plugin: str = ""

    def load(self) -> type:
        return import_object(self.config_cls)


R = TypeVar("R")


class _Registry(Generic[R]):
    kind = "record"

    def __init__(self) -> None:
        self._records: dict[str, R] = {}
        self.current_plugin = ""

    def add(self, record: R) -> None:
        name = record.name  # type: ignore[attr-defined]
        if name in self._records:
            other = self._records[name].plugin  # type: ignore[attr-defined]
            # no override order: which of two plugins wins would depend on install order
            raise PluginError(
                f"duplicate {self.kind} {name!r}: registered by plugin {other!r} and by {self.current_plugin!r}; "
                f"{self.kind} names are one namespace across plugins (rename one, or disable a plugin with "
                f"{DISABLE_ENV}=NAME)"
            )
        record.plugin = self.current_plugin  # type: ignore[attr-defined]
        self._records[name] = record

    def get(self, name: str) -> R:
        try:
            return self._records[name]
        except KeyError:
            known = ", ".join(sorted(self._records)) or "none"
            raise PluginError(f"unknown {self.kind} {name!r}; registered: {known}") from None

    def __contains__(self, name: str) -> bool:
        return name in self._records

    def __iter__(self):
        return iter(self._records.values())

    def __len__(self) -> int:
        return len(self._records)


class ArchitectureRegistry(_Registry[ArchSpec]):
    kind = "architecture"

    def register(self, name: str, hf_architectures, model_cls: str, **kw: Any) -> None:
        self.add(ArchSpec(name, tuple(hf_architectures), model_cls, **kw))

    def add(self, record: ArchSpec) -> None:
        for other in self:
            clash = set(other.hf_architectures) & set(record.hf_architectures)
            if clash:
                raise PluginError(
                    f"architecture {sorted(clash)} claimed by plugin {other.plugin!r} ({other.name}) "
                    f"and by {self.current_plugin!r} ({record.name})"
                )
        super().add(record)

    def for_hf_architecture(self, hf_arch: str) -> ArchSpec | None:
        for spec in self:
            if hf_arch in spec.hf_architectures:
                return spec
        return None


class ParserRegistry(_Registry[ParserSpec]):
    kind = "parser"

    def register(self, name: str, kind: str, parser_cls: str) -> None:
        if kind not in ("tool", "reasoning"):
            raise PluginError(f"parser {name!r}: kind must be 'tool' or 'reasoning', not {kind!r}")
        self.add(ParserSpec(name, kind, parser_cls))

    def of_kind(self, kind: str) -> list[ParserSpec]:
        return [p for p in self if p.kind == kind]


class KernelRegistry(_Registry[KernelSpec]):
    kind = "kernel"

    KINDS = ("reference", "triton", "native")

    def register(self, name: str, interface: str, impl: str, targets=(), *, priority: int = 0,
                 supports: str | None = None, architectures=(), kind: str = "triton") -> None:
        if kind not in self.KINDS:
            raise PluginError(f"kernel {name!r}: kind must be one of {self.KINDS}, not {kind!r}")
        for ref in (impl, supports):
            if ref is not None and ":" not in ref:
                raise PluginError(f"kernel {name!r}: lazy reference {ref!r} must look like 'package.module:Name'")
        if isinstance(architectures, str):
            architectures = (architectures,)
        self.add(KernelSpec(name, interface, impl, tuple(tuple(t) for t in targets), priority=int(priority),
                            supports=supports, architectures=tuple(architectures), kind=kind))

    def for_interface(self, interface: str) -> list[KernelSpec]:
        return [k for k in self if k.interface == interface]

    def interfaces(self) -> list[str]:
        """Every interface some implementation is registered for, in first-registration order."""
        return list(dict.fromkeys(k.interface for k in self))


class FormatRegistry(_Registry[FormatSpec]):
    kind = "model format"

    def register(self, name: str, source_cls: str, description: str = "") -> None:
        self.add(FormatSpec(name, source_cls, description))


class QuantizationRegistry(_Registry[QuantSpec]):
    kind = "quantization"

    def register(self, name: str, config_cls: str, description: str = "") -> None:
        self.add(QuantSpec(name, config_cls, description))


@dataclass(slots=True)
class PluginInfo:
    name: str
    distribution: str
    version: str
    architectures: list[str] = field(default_factory=list)
    parsers: list[str] = field(default_factory=list)
    kernels: list[str] = field(default_factory=list)
    formats: list[str] = field(default_factory=list)
    quantizations: list[str] = field(default_factory=list)


@dataclass(slots=True)
class BrokenPlugin:
    """An installed plugin that failed to import or whose registration hook raised; it was skipped."""

    name: str
    entry_point: str  # "package.module" as the entry point names it
    error: str  # "ExceptionType: message"
    distribution: str = ""
    version: str = ""

    def describe(self) -> str:
        return f"{self.name} ({self.entry_point}): {self.error}"


class PluginRegistry:
    """Loads plugins and collects what they register.

    ``PluginRegistry()`` holds core's defaults only; ``load_entry_points()`` adds installed
    plugins (minus ``ARMILLARY_DISABLE_PLUGINS``); ``register(module, name)`` adds one by hand,
    which is how tests register plugins without depending on autoload.
    """

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.architectures = ArchitectureRegistry()
        self.parsers = ParserRegistry()
        self.kernels = KernelRegistry()
        self.formats = FormatRegistry()
        self.quantizations = QuantizationRegistry()
        self.infos: dict[str, PluginInfo] = {}
        self.broken: dict[str, BrokenPlugin] = {}  # skipped by load_entry_points, with their errors
        from armillary import core_plugin

        self.register(core_plugin, "core", distribution="armillary")

    @staticmethod
    def disabled() -> set[str]:
        return {n.strip() for n in os.environ.get(DISABLE_ENV, "").split(",") if n.strip()}

    def register(self, module: Any, name: str, distribution: str = "", version: str = "") -> None:
        if name in self.infos:
            if self.pm.get_plugin(name) is module:
                return  # idempotent
            raise PluginError(f"duplicate plugin name {name!r}")
        if not version and distribution:
            version = _dist_version(distribution)
        info = PluginInfo(name, distribution or getattr(module, "__name__", name), version)
        self.pm.register(module, name)
        self.infos[name] = info
        for hook, registry, names in (
            ("armillary_register_architectures", self.architectures, info.architectures),
            ("armillary_register_parsers", self.parsers, info.parsers),
            ("armillary_register_kernels", self.kernels, info.kernels),
            ("armillary_register_model_formats", self.formats, info.formats),
            ("armillary_register_quantizations", self.quantizations, info.quantizations),
        ):
            before = set(r.name for r in registry)
            for impl in getattr(self.pm.hook, hook).get_hookimpls():
                if impl.plugin_name != name:
                    continue
                registry.current_plugin = name
                try:
                    impl.function(registry=registry)
                finally:
                    registry.current_plugin = ""
            names.extend(sorted(r.name for r in registry if r.name not in before))

    def load_entry_points(self) -> None:
        """Register every installed plugin but the disabled ones. A plugin that fails to import or
        whose hook raises is skipped with one warning and kept in ``broken``: it never hides the others."""
        blocked = self.disabled()
        for ep in entry_points(group=hookspecs.PROJECT):
            if ep.name in blocked or ep.name in self.infos or ep.name in self.broken:
                continue
            dist = ep.dist.name if ep.dist is not None else ""
            version = ep.dist.version if ep.dist is not None else ""
            stage = "import"
            try:
                module = ep.load()
                stage = "register"
                self.register(module, ep.name, dist, version)
            except Exception as exc:
                self._forget_plugin(ep.name)
                broken = BrokenPlugin(ep.name, ep.value, f"{type(exc).__name__}: {exc}", dist, version)
                self.broken[ep.name] = broken
                what = "failed to import" if stage == "import" else "failed to register"
                log.warning("plugin %r (%s%s) %s and is skipped: %s; disable it with %s=%s", ep.name, ep.value,
                            f", {dist} {version}".rstrip() if dist else "", what, broken.error, DISABLE_ENV,
                            ep.name)

    def _forget_plugin(self, name: str) -> None:
        """Undo a partial registration: whatever a plugin added before its hook raised."""
        if self.pm.get_plugin(name) is not None:
            self.pm.unregister(name=name)
        self.infos.pop(name, None)
        for registry in vars(self).values():
            if isinstance(registry, _Registry):
                registry._records = {k: r for k, r in registry._records.items()
                                     if getattr(r, "plugin", "") != name}
                registry.current_plugin = ""

    def recipe(self) -> list[tuple[str, str, str, str]]:
        """(module import path, name, distribution, version) of every plugin but core's, in registration order:
        what ``from_recipe`` needs to build the same registry in another process (a tensor-parallel rank)."""
        return [(self.pm.get_plugin(name).__name__, name, info.distribution, info.version)
                for name, info in self.infos.items() if name != "core"]

    @classmethod
    def from_recipe(cls, recipe: list[tuple[str, str, str, str]]) -> PluginRegistry:
        """A registry holding core's defaults and the plugins ``recipe()`` listed, imported by module path."""
        import importlib

        reg = cls()
        for module, name, distribution, version in recipe:
            reg.register(importlib.import_module(module), name, distribution, version)
        return reg

    @property
    def hook(self):
        return self.pm.hook

    def resolve_architecture(self, hf_architectures: list[str]) -> ArchSpec:
        for arch in hf_architectures:
            spec = self.architectures.for_hf_architecture(arch)
            if spec is not None:
                return spec
        served = sorted(a for s in self.architectures for a in s.hf_architectures)
        plugins = ", ".join(f"{i.name} ({', '.join(i.architectures) or 'no architectures'})" for i in self.infos.values())
        broken = "".join(f"; broken plugin {b.describe()}" for b in self.broken.values())
        hint = " (one of the broken plugins may be the one that serves it)" if self.broken else ""
        raise PluginError(
            f"no installed plugin serves architecture {hf_architectures}{hint}; "
            f"served architectures: {', '.join(served) or 'none'}; installed plugins: {plugins}{broken}"
        )


def _dist_version(distribution: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return ""


_default: PluginRegistry | None = None


def default_registry() -> PluginRegistry:
    """Core defaults plus every installed plugin, loaded once per process."""
    global _default
    if _default is None:
        reg = PluginRegistry()
        reg.load_entry_points()
        _default = reg
    return _default
