"""Where a model's config, weights, tokenizer and generation defaults come from.

Core reads Hugging Face directories (config.json + safetensors). A plugin adds other formats
(e.g. GGUF) through ``armillary_register_model_formats``: its ``ModelSource`` subclass says
whether it ``matches`` a ``--model`` argument, and the first match wins over the default.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from armillary.hf_config import HFConfig
from armillary.model_files import load_generation_defaults, load_hf_config, resolve_model_path

if TYPE_CHECKING:
    from armillary.registry import PluginRegistry
    from armillary.tokenizer import Tokenizer


class ModelSource(ABC):
    """One opened model. ``path`` is what the user named, resolved on disk."""

    path: Path

    @classmethod
    def matches(cls, model: str) -> bool:
        """Cheap check (no loading) whether this format serves the ``--model`` argument."""
        return False

    @abstractmethod
    def hf_config(self) -> HFConfig:
        """The model's configuration in Hugging Face ``config.json`` terms (``architectures`` included)."""

    @abstractmethod
    def iter_weights(self, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """``(checkpoint name, tensor)`` pairs, names as the architecture's ``load_weights`` expects."""

    @abstractmethod
    def tokenizer(self) -> Tokenizer | None:
        """The tokenizer shipped with the model, or None when it has none."""

    def generation_defaults(self) -> dict[str, Any]:
        return {}


class HFDirectory(ModelSource):
    """A Hugging Face checkpoint: a local directory or a repo id in the local HF cache."""

    def __init__(self, model: str, revision: str | None = None) -> None:
        self.path = resolve_model_path(model, revision)
        self._config = load_hf_config(self.path)

    def hf_config(self) -> HFConfig:
        return self._config

    def iter_weights(self, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        from armillary.weights import iter_safetensors

        return iter_safetensors(self.path, progress=progress)

    def tokenizer(self) -> Tokenizer | None:
        from armillary.tokenizer import Tokenizer

        return Tokenizer.from_pretrained(self.path) if (self.path / "tokenizer.json").exists() else None

    def generation_defaults(self) -> dict[str, Any]:
        return load_generation_defaults(self.path)


def open_model_source(model: str, revision: str | None, registry: PluginRegistry) -> ModelSource:
    """The first plugin format that matches ``model``, else a Hugging Face directory."""
    for spec in registry.formats:
        cls = spec.load()
        if cls.matches(model):
            return cls(model, revision)
    return HFDirectory(model, revision)
