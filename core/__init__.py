"""armillary: an LLM inference server for hybrid open models, with architectures as plugins."""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

try:
    __version__ = version("armillary")  # the installed distribution's metadata, so it never drifts
except PackageNotFoundError:  # imported from a bare source tree
    __version__ = "0+unknown"

__all__ = ["__version__", "LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput"]

if TYPE_CHECKING:
    from armillary.config import EngineConfig
    from armillary.engine import LLMEngine
    from armillary.llm import LLM
    from armillary.outputs import CompletionOutput, RequestOutput
    from armillary.sampling_params import SamplingParams

_LAZY = {"LLM": "armillary.llm", "LLMEngine": "armillary.engine", "EngineConfig": "armillary.config",
         "SamplingParams": "armillary.sampling_params", "RequestOutput": "armillary.outputs",
         "CompletionOutput": "armillary.outputs"}


def __getattr__(name: str):
    # lazy so that `armillary plugins` and plugin hook modules import without torch start-up cost
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'armillary' has no attribute {name!r}")
