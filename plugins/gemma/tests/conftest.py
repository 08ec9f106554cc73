"""Fixtures of the gemma plugin's tests: the plugin registered by hand and tiny checkpoints (``gemma_hf``)."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import armillary_gemma.hooks as gemma_hooks
from armillary.registry import PluginRegistry
from plugins.gemma.tests.gemma_hf import build_hf


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    """Small matmuls run fastest on one thread on a busy 2-core box (OpenMP waits dominate)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def gemma_registry() -> PluginRegistry:
    registry = PluginRegistry()
    registry.register(gemma_hooks, "gemma", distribution="armillary-gemma")
    return registry


@pytest.fixture
def tiny_gemma(tmp_path) -> Callable[[str], tuple[Path, torch.nn.Module]]:
    """``make(name)`` -> (directory saved with save_pretrained, the transformers model)."""

    def make(name: str, seed: int = 0) -> tuple[Path, torch.nn.Module]:
        model = build_hf(name, seed)
        directory = tmp_path / name
        model.save_pretrained(directory)
        return directory, model

    return make
