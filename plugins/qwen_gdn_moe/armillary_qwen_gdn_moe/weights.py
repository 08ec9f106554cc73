"""Checkpoint names -> parameters, for every layout these models ship in.

- prefixes: ``model.language_model.*`` (ConditionalGeneration) and ``model.*`` (ForCausalLM) both
  map to ``model.*``; ``lm_head.*`` and ``mtp.*`` stay; vision towers are skipped (one log line).
- experts: per-expert ``experts.E.{gate,up,down}_proj.weight`` or fused ``experts.gate_up_proj``
  [E, 2I, H] / ``experts.down_proj`` [E, H, I], both into the stacked parameters.
- stacked projections: modules with ``checkpoint_slot`` (attention's ``qkv_proj``, the MoE block's
  fused shared expert and router) say which rows of which parameter a checkpoint tensor fills.
- GDN input projection: Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba`` (grouped per key head) or
  Qwen3.5's ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``, both into the one
  ``in_proj`` with rows [q | k | v | z | b | a].

A parameter counts as loaded once every row of it has been written.
"""
from __future__ import annotations

import logging
import re
from collections.abc import Iterable

import torch
from torch import nn

from armillary.errors import WeightLoadError
from armillary_qwen_gdn_moe.gated_deltanet import GatedDeltaNet
from armillary_qwen_gdn_moe.moe import SparseMoeBlock

logger = logging.getLogger(__name__)

VISION_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.", "vision_tower.")
_PER_EXPERT = re.compile(r"^(?P<mod>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate|up|down)_proj\.weight$")
_GDN_PROJ = re.compile(r"^(?P<mod>.+\.linear_attn)\.in_proj_(?P<part>qkvz|ba|qkv|z|b|a)\.weight$")

Piece = tuple[str, tuple, torch.Tensor]  # (parameter name, index into it, values)


def checkpoint_to_param_name(name: str) -> str:
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    return name


class QwenWeightLoader:
    def __init__(self, model: nn.Module, tie_word_embeddings: bool) -> None:
        self.model = model
        self.tied = tie_word_embeddings
        self.has_mtp = getattr(model, "mtp", None) is not None
        self.params = dict(model.named_parameters())
        self.written: dict[str, torch.Tensor] = {}  # parameter -> bool mask over its rows (shape[:-1])
        # modules that store several checkpoint tensors in one parameter say where each one goes
        self.slotted = {n: m for n, m in model.named_modules() if hasattr(m, "checkpoint_slot")}
        self.num_routed = {n: m.num_experts for n, m in self.slotted.items() if isinstance(m, SparseMoeBlock)}

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
                pieces = self.pieces(name, tensor)
                if pieces is None or any(param_name not in self.params for param_name, _, _ in pieces):
                    unknown.append(ckpt_name)
                    continue
                for param_name, index, values in pieces:
                    self._write(ckpt_name, param_name, index, values)
        if skipped_vision:
            logger.info("skipped %d vision-tower tensors (text-only model)", skipped_vision)
        if skipped_mtp:
            logger.info("skipped %d mtp.* tensors (the config declares no MTP layers)", skipped_mtp)
        if unknown:
            shown = ", ".join(sorted(unknown)[:20])
            more = f" and {len(unknown) - 20} more" if len(unknown) > 20 else ""
            raise WeightLoadError(f"checkpoint tensors the model does not know: {shown}{more}")
        return {name for name, mask in self.written.items() if bool(mask.all())}

    def pieces(self, name: str, tensor: torch.Tensor) -> list[Piece] | None:
        if m := _PER_EXPERT.match(name):
            mod, expert, proj = m["mod"], int(m["e"]), m["proj"]
            if expert >= self.num_routed.get(mod.rsplit(".", 1)[0], expert + 1):
                return None  # slot E is the fused shared expert, not a checkpoint expert
            if proj == "down":
                return [(f"{mod}.down_proj", (expert,), tensor)]
            stacked = self.params.get(f"{mod}.gate_up_proj")
            if stacked is None:
                return None
            inter = stacked.shape[1] // 2
            rows = slice(0, inter) if proj == "gate" else slice(inter, 2 * inter)
            return [(f"{mod}.gate_up_proj", (expert, rows), tensor)]
        if m := _GDN_PROJ.match(name):
            return self._gdn_pieces(m["mod"], m["part"], tensor)
        module_name = name.rpartition(".")[0]
        while module_name:  # the nearest enclosing module that stacks checkpoint tensors decides
            if module_name in self.slotted:
                slot = self.slotted[module_name].checkpoint_slot(name[len(module_name) + 1:])
                if slot is not None:
                    return [(f"{module_name}.{slot[0]}", slot[1], tensor)]
                break
            module_name = module_name.rpartition(".")[0]
        if name in self.params:
            return [(name, (), tensor)]
        return None

    def _gdn_pieces(self, module_name: str, part: str, tensor: torch.Tensor) -> list[Piece] | None:
        try:
            gdn = self.model.get_submodule(module_name)
        except AttributeError:
            return None
        if not isinstance(gdn, GatedDeltaNet):
            return None
        target, rows = f"{module_name}.in_proj.weight", gdn.in_proj_rows()
        hidden = tensor.shape[-1]

        def piece(first: str, last: str, values: torch.Tensor) -> Piece:
            return (target, (slice(rows[first][0], rows[last][1]),), values)

        if part == "qkv":
            return [piece("q", "v", tensor)]
        if part in ("z", "b", "a"):
            return [piece(part, part, tensor)]
        # Qwen3-Next groups rows per key head: [q | k | v×r | z×r] and [b×r | a×r], r = HV / H
        groups, ratio = gdn.num_k_heads, gdn.num_v_heads // gdn.num_k_heads
        if part == "qkvz":
            sizes = [gdn.head_k_dim, gdn.head_k_dim, ratio * gdn.head_v_dim, ratio * gdn.head_v_dim]
            names = ["q", "k", "v", "z"]
        else:
            sizes, names = [ratio, ratio], ["b", "a"]
        if tensor.shape[0] != groups * sum(sizes):
            raise WeightLoadError(
                f"{module_name}.in_proj_{part}.weight has {tensor.shape[0]} rows, expected {groups * sum(sizes)}"
            )
        split = tensor.reshape(groups, sum(sizes), hidden).split(sizes, dim=1)
        return [piece(n, n, s.reshape(-1, hidden)) for n, s in zip(names, split)]

    def _write(self, ckpt_name: str, param_name: str, index: tuple, values: torch.Tensor) -> None:
        param = self.params[param_name]
        target = param.data[index]
        if target.shape != values.shape:
            raise WeightLoadError(
                f"checkpoint tensor {ckpt_name} has shape {tuple(values.shape)}, "
                f"{param_name}{_show(index)} expects {tuple(target.shape)}"
            )
        target.copy_(values)
        mask = self.written.get(param_name)
        if mask is None:
            mask = self.written[param_name] = torch.zeros(param.shape[:-1], dtype=torch.bool, device="cpu")
        mask[index] = True


def _show(index: tuple) -> str:
    if not index:
        return ""
    parts = [f"{i.start}:{i.stop}" if isinstance(i, slice) else str(i) for i in index]
    return "[" + ", ".join(parts) + "]"


def load_qwen_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], tie_word_embeddings: bool) -> set[str]:
    """Copy checkpoint tensors into ``model``; returns the parameter names completely written."""
    return QwenWeightLoader(model, tie_word_embeddings).load(weights)
