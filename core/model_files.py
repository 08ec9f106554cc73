"""Find a checkpoint on disk (local directory or Hugging Face cache) and read its JSON files."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from armillary.errors import ModelNotFoundError
from armillary.hf_config import HFConfig

# generation_config.json keys that become request defaults, copied only when present.
_GENERATION_KEYS = (
    "do_sample", "temperature", "top_p", "top_k", "min_p", "typical_p",
    "repetition_penalty", "presence_penalty", "frequency_penalty",
    "max_new_tokens", "max_length", "bos_token_id", "pad_token_id",
)


def hf_hub_cache_dir() -> Path:
    """The hub cache folder, read from the environment at call time (not at import)."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return Path(os.environ[name]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


def _is_repo_id(model: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if model.startswith((".", "/", "~")) or model.count("/") > 1:
        return False
    try:
        validate_repo_id(model)
    except HFValidationError:
        return False
    return True


def _listing(directory: Path, limit: int = 12) -> str:
    names = sorted(p.name for p in directory.iterdir())
    if not names:
        return "it is empty"
    shown = ", ".join(names[:limit]) + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")
    return f"it holds: {shown}"


def _from_hf_cache(repo_id: str, revision: str | None, cache: Path) -> Path | None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True)
    except LocalEntryNotFoundError:
        return None
    return Path(path)


def resolve_model_path(model: str | Path, revision: str | None = None,
                       require_config: bool = True, cache_dir: str | Path | None = None) -> Path:
    """A local directory, or a Hugging Face repo id found in the local cache (never downloaded).

    ``cache_dir`` (``--download-dir``) is the hub cache folder to look in instead of the environment's.

    Raises ``ModelNotFoundError`` naming the directory and the cache folder it looked in, and when
    ``require_config`` is set, when the directory has no ``config.json``.
    """
    name = str(model)
    local = Path(name).expanduser()
    if local.is_dir():
        path = local.resolve()
    elif local.exists():
        raise ModelNotFoundError(f"model path {str(local)!r} is a file; pass the checkpoint directory")
    elif _is_repo_id(name):
        cache = Path(cache_dir).expanduser() if cache_dir is not None else hf_hub_cache_dir()
        found = _from_hf_cache(name, revision, cache)
        if found is None:
            repo_folder = cache / f"models--{name.replace('/', '--')}"
            set_by = "--download-dir" if cache_dir is not None else "HF_HUB_CACHE / HF_HOME, or --download-dir"
            fetch = f"hf download {name}" + (f" --cache-dir {cache}" if cache_dir is not None else "")
            raise ModelNotFoundError(
                f"model {name!r} not found: no local directory {str(local.absolute())!r}, and no cached "
                f"snapshot (revision {revision or 'main'}) in the Hugging Face cache {str(repo_folder)!r} "
                f"(cache set by {set_by}). armillary does not download: fetch it first, e.g. `{fetch}`")
        path = found
    else:
        raise ModelNotFoundError(
            f"model directory {str(local.absolute())!r} does not exist (and {name!r} is not a valid "
            f"Hugging Face repo id)")
    if require_config and not (path / "config.json").is_file():
        raise ModelNotFoundError(f"model directory {str(path)!r} has no config.json; {_listing(path)}")
    return path


def _read_json(path: Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def load_hf_config(path: Path) -> HFConfig:
    """``config.json`` of a resolved checkpoint directory (with ``hf_quant_config.json`` as its
    ``quantization_config`` when config.json has none: ModelOpt's exports)."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ModelNotFoundError(f"model directory {str(path)!r} has no config.json")
    data = _read_json(file)
    modelopt = Path(path) / "hf_quant_config.json"  # ModelOpt's older exports keep their quantization here
    if modelopt.is_file() and "quantization_config" not in data and \
            "quantization_config" not in (data.get("text_config") or {}):
        data["quantization_config"] = {"quant_method": "modelopt", **_read_json(modelopt)}
    return HFConfig(data)


def load_generation_defaults(path: Path) -> dict[str, Any]:
    """Sampling defaults from ``generation_config.json``: only keys the file sets.

    ``eos_token_id`` is always returned as a list when present. Missing file: ``{}``.
    """
    file = Path(path) / "generation_config.json"
    if not file.is_file():
        return {}
    data = _read_json(file)
    defaults = {key: data[key] for key in _GENERATION_KEYS if data.get(key) is not None}
    eos = data.get("eos_token_id")
    if eos is not None:
        defaults["eos_token_id"] = [int(e) for e in eos] if isinstance(eos, list) else [int(eos)]
    return defaults


def checkpoint_dtype(config: HFConfig) -> str | None:
    """The dtype the checkpoint was saved in (``torch_dtype`` or ``dtype``), e.g. ``"bfloat16"``."""
    for cfg in (config, config.get("text_config")):
        if cfg is None:
            continue
        for key in ("torch_dtype", "dtype"):
            value = cfg.get(key)
            if isinstance(value, str) and value:
                return value.removeprefix("torch.")
    return None
