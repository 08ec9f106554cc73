"""The plugin contract: pluggy hook specifications for project ``armillary``.

Every hook receives a registry object and adds records to it, so hook signatures stay stable
while the records grow. Implementations must be cheap and must not touch CUDA: classes are
named lazily as ``"package.module:Class"`` strings and imported only when used.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import argparse

    from armillary.registry import (
        ArchitectureRegistry,
        FormatRegistry,
        KernelRegistry,
        ParserRegistry,
        QuantizationRegistry,
    )

PROJECT = "armillary"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def armillary_register_architectures(registry: ArchitectureRegistry) -> None:
    """Add ``ArchSpec`` records: which Hugging Face ``architectures`` names a model class serves."""


@hookspec
def armillary_register_parsers(registry: ParserRegistry) -> None:
    """Add tool-call and reasoning parsers (``ParserSpec``) by name."""


@hookspec
def armillary_register_kernels(registry: KernelRegistry) -> None:
    """Add named implementations (``KernelSpec``) of core kernel interfaces and their GPU targets."""


@hookspec
def armillary_register_model_formats(registry: FormatRegistry) -> None:
    """Add ``FormatSpec`` records: model file formats (e.g. GGUF) and the ``ModelSource`` that opens them."""


@hookspec
def armillary_register_quantizations(registry: QuantizationRegistry) -> None:
    """Add ``QuantSpec`` records: checkpoint formats by ``quantization_config.quant_method``, each a
    ``QuantConfig`` class that hands out the ``QuantMethod`` owning a layer's weights and kernels."""


@hookspec(firstresult=True)
def armillary_default_model() -> str | None:
    """Optional: what ``armillary serve`` serves when no model is named (the first answer wins)."""


@hookspec
def armillary_add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Optional: add plugin-specific flags to ``armillary serve``."""


@hookspec
def armillary_startup(config: Any) -> None:
    """Optional: called once with the engine configuration before the model is built."""
