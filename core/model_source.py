"""Where a model's config, weights, tokenizer and generation defaults come from.

Core reads Hugging Face directories (config.json + safetensors). A plugin adds other formats
(e.g. GGUF) through ``armillary_register_model_formats``: its ``ModelSource`` subclass says
whether it ``matches`` a ``--model`` argument, and the first match wins over the default.
"""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from armillary.hf_config import HFConfig
from armillary.model_files import load_generation_defaults, load_hf_config, resolve_model_path

if TYPE_CHECKING:
    from armillary.config import EngineConfig
    from armillary.registry import PluginRegistry
    from armillary.tokenizer import Tokenizer

log = logging.getLogger("armillary")


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

    def weights_on(self, device: torch.device, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """``iter_weights`` with tensors already on ``device`` where the format can read them there
        (safetensors: prefetched, pinned and copied in); by default, the CPU tensors of ``iter_weights``."""
        return self.iter_weights(progress)

    def weight_views(self) -> Iterator[tuple[str, torch.Tensor]] | None:
        """``iter_weights`` as views that read only the part a loader keeps (``shard_reads.LazySlice``, for a rank of
        several), or None where the format has none."""
        return None

    @abstractmethod
    def tokenizer(self) -> Tokenizer | None:
        """The tokenizer shipped with the model, or None when it has none."""

    def generation_defaults(self) -> dict[str, Any]:
        return {}


class HFDirectory(ModelSource):
    """A Hugging Face checkpoint: a local directory or a repo id in the local HF cache."""

    def __init__(self, model: str, revision: str | None = None, cache_dir: str | Path | None = None) -> None:
        self.path = resolve_model_path(model, revision, cache_dir=cache_dir)
        self._config = load_hf_config(self.path)

    def hf_config(self) -> HFConfig:
        return self._config

    def iter_weights(self, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        from armillary.weights import iter_safetensors

        return iter_safetensors(self.path, progress=progress)

    def weights_on(self, device: torch.device, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        from armillary.weights import iter_safetensors

        return iter_safetensors(self.path, progress=progress, device=device)

    def weight_views(self) -> Iterator[tuple[str, torch.Tensor]]:
        from armillary.shard_reads import lazy_safetensors
        from armillary.weights import safetensors_shards

        return lazy_safetensors(safetensors_shards(self.path))

    def tokenizer(self) -> Tokenizer | None:
        from armillary.tokenizer import Tokenizer

        return Tokenizer.from_pretrained(self.path) if (self.path / "tokenizer.json").exists() else None

    def generation_defaults(self) -> dict[str, Any]:
        return load_generation_defaults(self.path)


class ConfiguredSource(ModelSource):
    """A source with the engine configuration's overrides on top: ``tokenizer`` (another directory),
    ``chat_template`` (a file or inline template), ``generation_config`` (auto / vllm / a folder) and
    ``download_dir`` (the hub cache the tokenizer is looked up in). Anything else is the inner source's."""

    def __init__(self, inner: ModelSource, config: EngineConfig) -> None:
        self.inner = inner
        self.path = inner.path
        self.config = config

    def __getattr__(self, name: str) -> Any:  # format-specific attributes (e.g. a GGUF source's file)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def hf_config(self) -> HFConfig:
        return self.inner.hf_config()

    def iter_weights(self, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        return self.inner.iter_weights(progress)

    def weights_on(self, device: torch.device, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        return self.inner.weights_on(device, progress)

    def weight_views(self) -> Iterator[tuple[str, torch.Tensor]] | None:
        return self.inner.weight_views()

    def tokenizer(self) -> Tokenizer | None:
        from armillary.chat_template import load_chat_template
        from armillary.tokenizer import Tokenizer

        cfg = self.config
        if cfg.tokenizer:
            tokenizer = Tokenizer.from_pretrained(cfg.tokenizer, cfg.revision, cache_dir=cfg.download_dir)
        else:
            tokenizer = self.inner.tokenizer()
        if cfg.chat_template is not None:
            if tokenizer is None:
                log.warning("chat_template is ignored: %s has no tokenizer to render it with", self.path)
            else:
                tokenizer.override_chat_template(load_chat_template(cfg.chat_template))
                log.info("chat template: the one given (%d characters) instead of the checkpoint's",
                         len(tokenizer.chat_template or ""))
        return tokenizer

    def generation_defaults(self) -> dict[str, Any]:
        choice = self.config.generation_config
        if choice == "auto":
            return self.inner.generation_defaults()
        if choice == "vllm":  # no sampling defaults; the end-of-sequence ids are the model's, not defaults
            return {k: v for k, v in self.inner.generation_defaults().items() if k == "eos_token_id"}
        return load_generation_defaults(Path(choice).expanduser())


def open_model_source(model: str, revision: str | None, registry: PluginRegistry,
                      config: EngineConfig | None = None) -> ModelSource:
    """The first plugin format that matches ``model``, else a Hugging Face directory; with ``config``,
    its overrides (``ConfiguredSource``) on top."""
    for spec in registry.formats:
        cls = spec.load()
        if cls.matches(model):
            source: ModelSource = cls(model, revision)
            break
    else:
        source = HFDirectory(model, revision, config.download_dir if config is not None else None)
    return source if config is None else ConfiguredSource(source, config)
