"""The transformers side of a plugin test: a tiny model saved as a checkpoint, its greedy continuations and logits.

The caller builds the ``PreTrainedModel`` (its config class, seed and weight spreading are the
plugin's); nothing here imports transformers.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file


@dataclass(slots=True)
class Reference:
    """transformers' greedy continuation of each prompt and the logits behind every new token."""

    case: Any  # the plugin's description of the checkpoint (its test case), or None
    model_dir: Path
    prompts: list[list[int]]
    tokens: list[list[int]] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # per prompt [new_tokens, V], float32


@torch.no_grad()
def hf_greedy(hf_model: torch.nn.Module, prompt: list[int], new_tokens: int, pad_token_id: int = 0):
    """transformers' greedy ``generate`` of exactly ``new_tokens`` tokens (EOS suppressed), with the logits
    of each step: the output's ``sequences`` [1, len(prompt) + new_tokens] and ``logits`` (one [1, V] per step)."""
    ids = torch.tensor([prompt])
    return hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=pad_token_id)


def greedy_reference(hf_model: torch.nn.Module, model_dir: Path, prompts: list[list[int]], new_tokens: int,
                     case: Any = None) -> Reference:
    """Save ``hf_model`` to ``model_dir`` (``save_pretrained``: safetensors and config.json) and record its greedy
    continuation of every prompt."""
    hf_model.save_pretrained(model_dir)
    ref = Reference(case, Path(model_dir), prompts)
    for prompt in prompts:
        out = hf_greedy(hf_model, prompt, new_tokens)
        ref.tokens.append(out.sequences[0, len(prompt):].tolist())
        ref.logits.append(torch.cat(out.logits).float())
    return ref


def lazy_references(make: Callable[[Any, Path], Reference], tmp_path_factory) -> Callable[[Any], Reference]:
    """For a module-scoped fixture: ``get(case)`` builds ``make(case, fresh directory)`` once per ``case.name``,
    so a module's tests share each case's checkpoint and only the cases they use are built."""
    built: dict[str, Reference] = {}

    def get(case: Any) -> Reference:
        if case.name not in built:
            built[case.name] = make(case, tmp_path_factory.mktemp(case.name))
        return built[case.name]

    return get


def read_checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    """The tensors of a one-shard ``model.safetensors`` checkpoint."""
    return load_file(str(Path(model_dir) / "model.safetensors"))


def write_checkpoint(model_dir: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any] | None = None,
                     source: Path | None = None) -> None:
    """Write ``tensors`` (and ``config`` or ``source``'s config.json) as a one-shard checkpoint in ``model_dir``."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    if config is None:
        config = json.loads((Path(source) / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(model_dir / "model.safetensors"))


_PER_EXPERT = re.compile(r"^(.+\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def swap_expert_layout(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """MoE expert tensors in the other checkpoint layout: per-expert ``experts.E.{gate,up,down}_proj.weight``
    <-> stacked ``experts.gate_up_proj`` [E, 2I, H] / ``experts.down_proj`` [E, H, I]; other tensors as they are."""
    out: dict[str, torch.Tensor] = {}
    grouped: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name, t in tensors.items():
        if m := _PER_EXPERT.match(name):
            grouped.setdefault(m[1], {})[(int(m[2]), m[3])] = t
        elif name.endswith(".experts.gate_up_proj"):
            prefix = name[: -len(".gate_up_proj")]
            for e, w in enumerate(t):
                out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = w.chunk(2, dim=0)
        elif name.endswith(".experts.down_proj"):
            prefix = name[: -len(".down_proj")]
            for e, w in enumerate(t):
                out[f"{prefix}.{e}.down_proj.weight"] = w
        else:
            out[name] = t
    for prefix, parts in grouped.items():
        n = 1 + max(e for e, _ in parts)
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat((parts[e, "gate"], parts[e, "up"])) for e in range(n)])
        out[f"{prefix}.down_proj"] = torch.stack([parts[e, "down"] for e in range(n)])
    return out
