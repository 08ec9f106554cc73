"""Fixtures of the gemma plugin's tests: the plugin registered by hand and tiny checkpoints (``gemma_hf``).

One intra-op thread per module comes from the repository's conftest.py, as for every suite."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import armillary_gemma.hooks as gemma_hooks
from armillary.registry import PluginRegistry
from armillary.testing import plugin_registry
from plugins.gemma.tests.gemma_hf import build_hf


@pytest.fixture
def gemma_registry() -> PluginRegistry:
    return plugin_registry(gemma_hooks, "gemma", distribution="armillary-gemma")


@pytest.fixture
def tiny_gemma(tmp_path) -> Callable[[str], tuple[Path, torch.nn.Module]]:
    """``make(name)`` -> (directory saved with save_pretrained, the transformers model)."""

    def make(name: str, seed: int = 0) -> tuple[Path, torch.nn.Module]:
        model = build_hf(name, seed)
        directory = tmp_path / name
        model.save_pretrained(directory)
        return directory, model

    return make
