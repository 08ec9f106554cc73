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

FP8 checkpoints (``quant_method: fp8`` / compressed-tensors) add, beside each quantized weight,
``weight_scale_inv`` / ``weight_scale`` (block or per-channel scales; the layers' quant methods own
them): those of attention's ``{q,k,v}_proj`` and of the GDN input projection go into the matching
slots of ``qkv_proj`` / ``in_proj`` here, fused experts' ``experts.{gate_up,down}_proj_scale_inv``
into ``experts.{gate_up,down}_proj_weight_scale_inv``; ``input_scale`` of dynamic schemes is not
stored (refused); attention's ``k_scale`` / ``v_scale`` (FP8 KV cache scales) are kept in
``model.checkpoint_kv_scales[layer] = {"k": float, "v": float}`` for the KV cache layout.

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

VISION_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.", "vision_tower.")
SCALE_ATTRS = ("weight_scale_inv", "weight_scale")
_ATTN_SCALE = re.compile(r"(?P<mod>.+\.self_attn)\.(?P<proj>[qkv])_proj\.(?P<attr>weight_scale_inv|weight_scale)")
_GDN_SCALE = re.compile(r"(?P<mod>.+\.linear_attn)\.in_proj_(?P<part>qkvz|qkv|ba|z|b|a)\.(?P<attr>weight_scale_inv|weight_scale)")
_FUSED_EXPERT_SCALE = re.compile(r"(?P<mod>.+\.experts)\.(?P<base>gate_up_proj|down_proj)_scale_inv")
_KV_SCALE = re.compile(r".*layers\.(?P<layer>\d+)\.self_attn\.(?:[kv]_proj\.|attn\.)?(?P<which>[kv])_scale")


def checkpoint_to_param_name(name: str) -> str:
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    return name


class QwenWeightLoader:
    def __init__(self, model: nn.Module, tie_word_embeddings: bool) -> None:
        self.tied = tie_word_embeddings
        self.model = model
        self.has_mtp = getattr(model, "mtp", None) is not None
        self.loader = CheckpointLoader(model)
        self.takes_input_scale = any(n.endswith("input_scale") for n in self.loader.params)  # static (ModelOpt) schemes

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
                if name.startswith("model.") and self._fp8_extra(name, tensor, ckpt_name):
                    continue
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


    def _fp8_extra(self, name: str, tensor: torch.Tensor, source: str) -> bool:
        """FP8 scale tensors the modules' own name mapping does not know; True when handled here."""
        m = _KV_SCALE.fullmatch(name)
        if m is not None:
            scales = self.model.__dict__.setdefault("checkpoint_kv_scales", {})
            scales.setdefault(int(m["layer"]), {})[m["which"]] = float(tensor.float().reshape(-1).max())
            return True
        if name.endswith(".input_scale") and not self.takes_input_scale:
            raise WeightLoadError(f"{source}: static activation scales (input_scale) are not supported; armillary "
                                  "quantizes activations dynamically (use a dynamic-activation FP8 checkpoint)")
        m = _FUSED_EXPERT_SCALE.fullmatch(name)
        if m is not None:
            return self._load(f"{m['mod']}.{m['base']}_weight_scale_inv", tensor, {}, source)
        m = _ATTN_SCALE.fullmatch(name)
        if m is not None:
            return self._load(f"{m['mod']}.qkv_proj.{m['attr']}", tensor, {"shard_id": m["proj"]}, source)
        m = _GDN_SCALE.fullmatch(name)
        if m is None:
            return False
        gdn = self.model.get_submodule(m["mod"])
        block_rows = gdn.in_proj.fp8_block[0] if hasattr(gdn.in_proj, "fp8_block") else 1
        target = f"{m['mod']}.in_proj.{m['attr']}"
        for shard, piece in _gdn_scale_pieces(gdn, m["part"], tensor, block_rows, source):
            self._load(target, piece, {"shard_id": shard}, source)
        return True

    def _load(self, param_name: str, tensor: torch.Tensor, kwargs: dict, source: str) -> bool:
        param = self.loader.params.get(param_name)
        if param is None:
            raise WeightLoadError(f"checkpoint tensor {source}: the model has no {param_name} (is this layer "
                                  "quantized in the checkpoint but not in the model's quantization config?)")
        try:
            index = param.weight_loader(param, tensor, **kwargs)
        except WeightLoadError as exc:
            raise WeightLoadError(f"checkpoint tensor {source} -> {param_name}: {exc}") from None
        self.loader.rows.mark(param_name, param, index)
        return True


def _gdn_scale_pieces(gdn: nn.Module, part: str, scale: torch.Tensor, block_rows: int,
                      source: str) -> list[tuple[int, torch.Tensor]]:
    """A GDN input projection's scale rows -> (slot of ``in_proj``, rows), as its weight is split;
    the rows are in units of ``block_rows`` weight rows, so every split must fall on block edges."""
    from armillary_qwen_gdn_moe.gated_deltanet import IN_PROJ_SHARDS

    ratio = gdn.num_v_heads // gdn.num_k_heads
    if part == "qkvz":  # grouped per key head: [q | k | v×r | z×r]
        sizes, groups = [gdn.head_k_dim, gdn.head_k_dim, ratio * gdn.head_v_dim, ratio * gdn.head_v_dim], gdn.num_k_heads
    elif part == "ba":  # grouped per key head: [b×r | a×r]
        sizes, groups = [ratio, ratio], gdn.num_k_heads
    else:
        sizes = [gdn.in_proj_sizes[IN_PROJ_SHARDS.index(n)] for n in part]
        groups = 1
    if any(s % block_rows for s in sizes):
        raise WeightLoadError(f"{source}: slots of {sizes} rows do not fall on the fp8 blocks of {block_rows} rows")
    units = [s // block_rows for s in sizes]
    if scale.shape[0] != groups * sum(units):
        raise WeightLoadError(f"{source}: expected {groups * sum(units)} scale rows, got shape {tuple(scale.shape)}")
    split = scale.reshape(groups, sum(units), -1).split(units, dim=1)
    return [(IN_PROJ_SHARDS.index(n), piece.reshape(-1, scale.shape[-1])) for n, piece in zip(part, split)]


def load_qwen_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], tie_word_embeddings: bool) -> set[str]:
    """Copy checkpoint tensors into ``model``; returns the parameter names completely written."""
    return QwenWeightLoader(model, tie_word_embeddings).load(weights)
