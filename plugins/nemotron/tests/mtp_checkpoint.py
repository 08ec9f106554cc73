"""Tiny ``nemotron_h`` checkpoints with an MTP head, as Nemotron-3 Super publishes it: transformers'
NemotronH implements no MTP, so a transformers model is built with the MTP sublayers appended to its
pattern, and those trailing blocks are renamed ``mtp.layers.{j}.*``; the config then declares them
(``num_nextn_predict_layers`` 1, ``mtp_layers_block_type``), and random ``enorm`` / ``hnorm`` /
``eh_proj`` (first sublayer) and ``final_layernorm`` (last) are added."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers as tf

from armillary.testing import read_checkpoint, write_checkpoint
from plugins.nemotron.tests.hf_models import CASES_BY_NAME, Case, build_hf_model

_TYPES = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}


@dataclass(frozen=True)
class MTPCheckpoint:
    model_dir: Path
    hf: tf.PreTrainedModel  # transformers' model whose trailing blocks are the MTP sublayers
    num_main: int  # main layers; hf.model.layers[num_main + j] is MTP sublayer j
    extra: dict[str, torch.Tensor]  # the MTP-only tensors: mtp.layers.0.{enorm,hnorm,eh_proj}, final_layernorm


def save_with_mtp(case_name: str, mtp_pattern: str, model_dir: Path, seed: int = 7) -> MTPCheckpoint:
    """``case_name``'s tiny model with an MTP head of sublayers ``mtp_pattern`` (e.g. ``"*E"``) in ``model_dir``."""
    case = CASES_BY_NAME[case_name]
    main = case.config["hybrid_override_pattern"]
    hf = build_hf_model(Case(f"{case_name}+mtp", dict(case.config, hybrid_override_pattern=main + mtp_pattern)))
    hf.save_pretrained(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    tensors = read_checkpoint(model_dir)
    n = len(main)
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        parts = name.split(".")
        if name.startswith("backbone.layers.") and int(parts[2]) >= n:
            out[".".join(["mtp", "layers", str(int(parts[2]) - n), *parts[3:]])] = t
        else:
            out[name] = t
    gen = torch.Generator().manual_seed(seed)
    hidden = case.config["hidden_size"]
    last = len(mtp_pattern) - 1
    extra = {
        "mtp.layers.0.enorm.weight": 1 + 0.3 * torch.randn(hidden, generator=gen),
        "mtp.layers.0.hnorm.weight": 1 + 0.3 * torch.randn(hidden, generator=gen),
        "mtp.layers.0.eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=gen) * (2 * hidden) ** -0.5,
        f"mtp.layers.{last}.final_layernorm.weight": 1 + 0.3 * torch.randn(hidden, generator=gen),
    }
    out.update(extra)
    config.pop("hybrid_override_pattern", None)
    config["layers_block_type"] = [_TYPES[c] for c in main]
    config["num_hidden_layers"] = n
    config["num_nextn_predict_layers"] = 1
    config["mtp_layers_block_type"] = [_TYPES[c] for c in mtp_pattern]
    write_checkpoint(model_dir, out, config)
    return MTPCheckpoint(model_dir, hf, n, extra)
