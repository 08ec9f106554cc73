"""Stream safetensors checkpoints shard by shard into a model's ``load_weights``."""
from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from armillary.errors import WeightLoadError
from armillary.safetensors_stream import stream_safetensors

logger = logging.getLogger(__name__)

_INDEX_FILE = "model.safetensors.index.json"
_MAX_LISTED = 20


def _names_listed(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (f", ... ({len(names) - _MAX_LISTED} more)" if len(names) > _MAX_LISTED else "")


def safetensors_shards(path: Path) -> list[Path]:
    """The shard files of a checkpoint: those the index names when it exists, else every ``*.safetensors``."""
    path = Path(path)
    index = path / _INDEX_FILE
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map") or {}
        shards = [path / name for name in sorted(set(weight_map.values()))]
        missing = [s.name for s in shards if not s.is_file()]
        if missing:
            raise WeightLoadError(f"{index} names shards that are not in {path}: {_names_listed(missing)}")
        if not shards:
            raise WeightLoadError(f"{index} has an empty weight_map")
        return shards
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        present = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
        weight_like = [n for n in present if n.endswith((".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5"))]
        hint = (f"it holds only {_names_listed(weight_like)}, which armillary does not load; convert the "
                "checkpoint to safetensors") if weight_like else f"it holds: {_names_listed(present) or 'nothing'}"
        raise WeightLoadError(f"no *.safetensors files in {path}; {hint}")
    return shards


def iter_safetensors(path: Path, progress: bool = True,
                     device: torch.device | str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(checkpoint name, tensor on device)`` over all shards, read ahead by reader threads
    (``armillary.safetensors_stream``); progress is a bar on a terminal, else a log line per shard."""
    return stream_safetensors(safetensors_shards(path), device, progress=progress)


def load_model_weights(model: nn.Module, path: Path, progress: bool = True) -> None:
    """Fill every parameter of ``model`` from the safetensors checkpoint at ``path``."""
    fill_parameters(model, iter_safetensors(path, progress=progress), str(path))


def fill_parameters(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
    """Feed ``weights`` to ``model.load_weights``; raise ``WeightLoadError`` naming unfilled parameters.

    ``load_weights`` itself raises on checkpoint tensors it does not know. Buffers are not checked.
    """
    filled = set(model.load_weights(weights))
    unfilled = [name for name, _ in model.named_parameters() if name not in filled]
    if unfilled:
        raise WeightLoadError(
            f"checkpoint {source} left {len(unfilled)} parameter(s) of {type(model).__name__} unfilled: "
            f"{_names_listed(unfilled)}")
    logger.info("loaded %d parameters from %s", len(filled), source)
