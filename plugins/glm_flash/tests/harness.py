"""Drive the real engine's model, latent cache and runner with hand-picked steps (the glm_flash plugin registered by hand)."""
from __future__ import annotations

from pathlib import Path

import armillary_glm_flash.hooks as glm_hooks
from armillary.engine import LLMEngine
from armillary.registry import PluginRegistry
from armillary.testing import StepHarness, cpu_engine, plugin_registry


def glm_registry() -> PluginRegistry:
    return plugin_registry(glm_hooks, "glm_flash")


def build_engine(model_dir: Path, dtype: str = "float32", **kw) -> LLMEngine:
    return cpu_engine(model_dir, glm_registry(), dtype, **kw)


class Harness(StepHarness):
    """``step([(seq_id, new_tokens), ...], decode_only=, no_host_lists=, all_rows=)`` runs one forward and returns
    each sequence's last logits (or every row's); see ``armillary.testing.StepHarness``."""

    def __init__(self, model_dir: Path, dtype: str = "float32", block_size: int = 8) -> None:
        super().__init__(build_engine(model_dir, dtype, block_size=block_size, num_kv_blocks=128, max_num_seqs=8))
