"""Drive the real engine's model, pools and runner with hand-picked steps.

The engine loads the checkpoint (through the plugin registered by hand) and owns the caches;
``Harness.step`` (``armillary.testing.StepHarness``) chooses exactly which tokens of which sequences
go into one forward, which the scheduler would otherwise decide, and returns each sequence's last logits.
"""
from __future__ import annotations

from pathlib import Path

import torch

import armillary_qwen_gdn_moe.hooks as qwen_hooks
from armillary.engine import LLMEngine
from armillary.hf_config import HFConfig
from armillary.registry import PluginRegistry
from armillary.testing import StepHarness, cpu_engine, plugin_registry


def qwen_registry() -> PluginRegistry:
    return plugin_registry(qwen_hooks, "qwen_gdn_moe")


def build_engine(model_dir: Path, dtype: str = "float32", **kw) -> LLMEngine:
    return cpu_engine(model_dir, qwen_registry(), dtype, **kw)


def build_model(model_dir: Path, dtype: str = "float32") -> tuple[torch.nn.Module, HFConfig]:
    """The loaded model (the engine's loader fails on unfilled or unknown tensors)."""
    engine = build_engine(model_dir, dtype, num_kv_blocks=4, max_num_seqs=1)
    return engine.model, engine.hf_config


class Harness(StepHarness):
    """``step([(seq_id, new_tokens), ...])`` runs one forward and returns each sequence's last logits."""

    def __init__(self, model_dir: Path, dtype: str = "float32") -> None:
        super().__init__(build_engine(model_dir, dtype, block_size=8, num_kv_blocks=128, max_num_seqs=8))
