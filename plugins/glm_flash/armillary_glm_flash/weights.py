"""Checkpoint names -> parameters of ``Glm4MoeLiteForCausalLM``.

- ``model.layers.{i}.*`` (i < num_hidden_layers), ``model.embed_tokens``, ``model.norm``, ``lm_head``
  keep their names; experts come per expert (``mlp.experts.E.{gate,up,down}_proj.weight``, as
  published) or stacked (``mlp.experts.gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I], as
  transformers 5 holds them), both through ``FusedMoE``; ``mlp.shared_experts.*`` become the
  shared experts of the same ``FusedMoE`` (``MoEBlock``); the router is ``mlp.gate.weight`` and
  ``mlp.gate.e_score_correction_bias``; ``gate_proj`` / ``up_proj`` of a dense MLP fill its merged
  ``gate_up_proj`` (``GatedMLP``).
- ``model.layers.{num_hidden_layers}.*`` is the MTP layer: loaded as ``mtp.*`` when the config
  declares it (``num_nextn_predict_layers``), skipped otherwise; its ``embed_tokens`` and
  ``shared_head.head`` copies are skipped (the draft uses the main ones).

A parameter counts as loaded once every row of it has been written.
"""
from __future__ import annotations

import logging
import re
from collections.abc import Iterable

import torch
from torch import nn

from armillary.errors import WeightLoadError
from armillary.layers import CheckpointLoader

logger = logging.getLogger(__name__)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_MTP_COPIES = ("embed_tokens.", "shared_head.head.")  # duplicates of the main embedding / LM head


def load_glm_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], num_layers: int,
                     tied: bool) -> set[str]:
    """Copy checkpoint tensors into ``model``; returns the parameter names completely written."""
    loader = CheckpointLoader(model)
    has_mtp = getattr(model, "mtp", None) is not None
    unknown: list[str] = []
    skipped_mtp = skipped_copies = 0
    with torch.no_grad():
        for ckpt_name, tensor in weights:
            name = ckpt_name
            m = _LAYER.match(name)
            if m is not None and int(m[1]) >= num_layers:
                if int(m[1]) > num_layers or not has_mtp:
                    skipped_mtp += 1
                    continue
                if m[2].startswith(_MTP_COPIES):
                    skipped_copies += 1
                    continue
                name = f"mtp.{m[2]}"
            elif name == "lm_head.weight" and tied:
                continue  # the tied head is the embedding
            elif name.endswith("rotary_emb.inv_freq"):
                continue
            if loader.load(name, tensor, source=ckpt_name) is None:
                unknown.append(ckpt_name)
    if skipped_mtp:
        logger.info("skipped %d MTP-layer tensors (the config declares no MTP layer there)", skipped_mtp)
    if skipped_copies:
        logger.info("skipped %d MTP copies of the embedding / LM head (the draft head uses the main ones)",
                    skipped_copies)
    if unknown:
        shown = ", ".join(sorted(unknown)[:20])
        more = f" and {len(unknown) - 20} more" if len(unknown) > 20 else ""
        raise WeightLoadError(f"checkpoint tensors the model does not know: {shown}{more}")
    return loader.loaded()
