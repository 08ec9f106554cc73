"""Tiny checkpoints with an MTP head: transformers' tiny models carry none, so one is added as
Qwen publishes it (``mtp.fc``, ``mtp.pre_fc_norm_*``, ``mtp.layers.0.*``, ``mtp.norm``,
``mtp_num_hidden_layers`` in the text config), its decoder layer a perturbed copy of a full-attention
layer of the main model."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from plugins.qwen_gdn_moe.tests.hf_models import Case, build_hf_model, read_checkpoint, write_checkpoint

F = "full_attention"


def save_with_mtp(case: Case, model_dir: Path, seed: int = 7) -> Path:
    """``case``'s tiny model saved to ``model_dir`` with a random MTP head added; returns the folder."""
    build_hf_model(case).save_pretrained(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    text = config.get("text_config", config)
    text["mtp_num_hidden_layers"] = 1
    tensors = read_checkpoint(model_dir)
    prefix = "model.language_model." if "text_config" in config else "model."
    layer = text["layer_types"].index(F)
    if layer in (text.get("mlp_only_layers") or []):
        raise ValueError("pick a case whose first full-attention layer is an MoE layer")
    gen = torch.Generator().manual_seed(seed)
    hidden = text["hidden_size"]
    source = f"{prefix}layers.{layer}."
    for name, t in list(tensors.items()):
        if name.startswith(source):
            noise = torch.randn(t.shape, generator=gen) * 0.05 * (t.float().std() if t.numel() > 1 else 1.0)
            tensors["mtp.layers.0." + name[len(source):]] = (t.float() + noise).to(t.dtype)
    tensors["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=gen) * (2 * hidden) ** -0.5
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = torch.randn(hidden, generator=gen) * 0.3
    write_checkpoint(model_dir, tensors, config)
    return model_dir
