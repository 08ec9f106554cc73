"""Checkpoint names -> parameters, for every layout these models ship in.

- prefixes: ``model.language_model.*`` (ConditionalGeneration) and ``model.*`` (ForCausalLM) both
  map to ``model.*``; ``lm_head.*`` and ``mtp.*`` stay; vision towers are skipped (one log line).
- everything else goes through core's ``CheckpointLoader``: the nearest enclosing module with
  ``checkpoint_pieces`` says where a tensor lands, and each parameter's ``weight_loader`` writes it:
  - experts: per-expert ``experts.E.{gate,up,down}_proj.weight`` (``FusedMoE``) or fused
    ``experts.gate_up_proj`` [E, 2I, H] / ``experts.down_proj`` [E, H, I], both into the stacked
    parameters; a shared expert as wide as the routed ones becomes expert ``E`` and its gate row
    ``E`` of the router (``SparseMoeBlock``);
  - attention's ``{q,k,v}_proj`` into the slots of ``qkv_proj`` (``GatedAttention``);
  - GDN input projection: Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba`` (grouped per key head) or
    Qwen3.5's ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``, both into the one
    ``in_proj`` with rows [q | k | v | z | b | a] (``GatedDeltaNet``).

A parameter counts as loaded once every row of it has been written.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from armillary.errors import WeightLoadError
from armillary.layers import CheckpointLoader

logger = logging.getLogger(__name__)

VISION_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.", "vision_tower.")


def checkpoint_to_param_name(name: str) -> str:
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    return name


class QwenWeightLoader:
    def __init__(self, model: nn.Module, tie_word_embeddings: bool) -> None:
        self.tied = tie_word_embeddings
        self.has_mtp = getattr(model, "mtp", None) is not None
        self.loader = CheckpointLoader(model)

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        unknown: list[str] = []
        skipped_vision = skipped_mtp = 0
        with torch.no_grad():
            for ckpt_name, tensor in weights:
                if ckpt_name.startswith(VISION_PREFIXES):
                    skipped_vision += 1
                    continue
                name = checkpoint_to_param_name(ckpt_name)
                if name.startswith("mtp.") and not self.has_mtp:
                    skipped_mtp += 1
                    continue
                if name == "lm_head.weight" and self.tied:
                    continue  # the tied head is the embedding
                if self.loader.load(name, tensor, source=ckpt_name) is None:
                    unknown.append(ckpt_name)
        if skipped_vision:
            logger.info("skipped %d vision-tower tensors (text-only model)", skipped_vision)
        if skipped_mtp:
            logger.info("skipped %d mtp.* tensors (the config declares no MTP layers)", skipped_mtp)
        if unknown:
            shown = ", ".join(sorted(unknown)[:20])
            more = f" and {len(unknown) - 20} more" if len(unknown) > 20 else ""
            raise WeightLoadError(f"checkpoint tensors the model does not know: {shown}{more}")
        return self.loader.loaded()


def load_qwen_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], tie_word_embeddings: bool) -> set[str]:
    """Copy checkpoint tensors into ``model``; returns the parameter names completely written."""
    return QwenWeightLoader(model, tie_word_embeddings).load(weights)
