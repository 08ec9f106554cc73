"""Model resolution (local dir, HF cache), JSON config helpers, safetensors streaming and weight loading."""
from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from armillary.errors import ModelNotFoundError, WeightLoadError
from armillary.hf_config import HFConfig
from armillary.model_files import (
    checkpoint_dtype,
    load_generation_defaults,
    load_hf_config,
    resolve_model_path,
)
from armillary.weights import iter_safetensors, load_model_weights

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _write_config(directory: Path, **extra) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "tiny", **extra}))


def _fake_hf_cache(cache: Path, repo_id: str, revision: str = "main") -> Path:
    """Lay out ``models--org--name`` the way huggingface_hub stores a downloaded snapshot."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    _write_config(snapshot, hidden_size=8)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / revision).write_text(COMMIT)
    return snapshot


# --- resolution ---------------------------------------------------------------------------------


def test_resolves_local_directory(tmp_path):
    _write_config(tmp_path / "model")
    assert resolve_model_path(str(tmp_path / "model")) == (tmp_path / "model").resolve()


def test_directory_without_config_names_its_contents(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model_path(tmp_path / "model")
    assert "no config.json" in str(err.value) and "tokenizer.json" in str(err.value)
    assert resolve_model_path(tmp_path / "model", require_config=False) == (tmp_path / "model").resolve()


def test_resolves_repo_id_from_hf_hub_cache(tmp_path, monkeypatch):
    snapshot = _fake_hf_cache(tmp_path / "hub", "tiny-org/tiny-model")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("tiny-org/tiny-model") == snapshot
    assert resolve_model_path("tiny-org/tiny-model", revision=COMMIT) == snapshot


def test_resolves_repo_id_from_hf_home(tmp_path, monkeypatch):
    snapshot = _fake_hf_cache(tmp_path / "home" / "hub", "tiny-org/tiny-model")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("tiny-org/tiny-model") == snapshot


def test_missing_repo_id_names_directory_and_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model_path("Qwen/Not-Downloaded")
    message = str(err.value)
    assert "'Qwen/Not-Downloaded'" in message
    assert str(tmp_path / "Qwen" / "Not-Downloaded") in message
    assert str(tmp_path / "hub" / "models--Qwen--Not-Downloaded") in message
    assert "revision main" in message


def test_missing_revision_is_not_found(tmp_path, monkeypatch):
    _fake_hf_cache(tmp_path / "hub", "tiny-org/tiny-model")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFoundError, match="revision v2"):
        resolve_model_path("tiny-org/tiny-model", revision="v2")


def test_missing_local_path_is_not_found(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model_path(str(tmp_path / "nowhere" / "deep" / "model"))


# --- config helpers -----------------------------------------------------------------------------


def test_generation_defaults_only_present_keys(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "eos_token_id": 5, "transformers_version": "5"}))
    assert load_generation_defaults(tmp_path) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                                  "eos_token_id": [5]}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 3], "min_p": 0.0}))
    assert load_generation_defaults(tmp_path) == {"eos_token_id": [7, 3], "min_p": 0.0}
    assert load_generation_defaults(tmp_path / "missing") == {}


def test_checkpoint_dtype(tmp_path):
    _write_config(tmp_path, torch_dtype="bfloat16")
    assert checkpoint_dtype(load_hf_config(tmp_path)) == "bfloat16"
    assert checkpoint_dtype(HFConfig({"dtype": "float16"})) == "float16"
    assert checkpoint_dtype(HFConfig({"text_config": {"dtype": "torch.bfloat16"}})) == "bfloat16"
    assert checkpoint_dtype(HFConfig({"model_type": "x"})) is None


# --- safetensors --------------------------------------------------------------------------------


class TinyModel(nn.Module):
    """Implements the ``load_weights`` contract with one renamed checkpoint tensor and a tied head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.proj = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied: one parameter under two names
        self.register_buffer("inv_freq", torch.ones(2))  # buffers are not checkpoint tensors

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        filled = set()
        for name, tensor in weights:
            target = name.removeprefix("model.")
            if target not in params:
                raise WeightLoadError(f"unknown checkpoint tensor {name}")
            with torch.no_grad():
                params[target].copy_(tensor)
            filled.add(target)
        return filled


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"model.embed.weight": torch.randn(10, 4, generator=g),
            "model.proj.weight": torch.randn(4, 4, generator=g),
            "model.proj.bias": torch.randn(4, generator=g)}


def _write_sharded(directory: Path, tensors: dict[str, torch.Tensor], with_index: bool = True) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:1], "model-00002-of-00002.safetensors": names[1:]}
    for file, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, str(directory / file))
    if with_index:
        weight_map = {n: file for file, shard_names in shards.items() for n in shard_names}
        (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_iter_safetensors_reads_all_shards(tmp_path):
    tensors = _tensors()
    _write_sharded(tmp_path, tensors)
    save_file({"stray": torch.zeros(1)}, str(tmp_path / "not-in-index.safetensors"))
    got = dict(iter_safetensors(tmp_path, progress=False))
    assert sorted(got) == sorted(tensors)  # the index decides; the stray file is ignored
    for name, tensor in tensors.items():
        assert torch.equal(got[name], tensor)


def test_iter_safetensors_without_index_reads_every_file(tmp_path):
    _write_sharded(tmp_path, _tensors(), with_index=False)
    assert sorted(n for n, _ in iter_safetensors(tmp_path, progress=False)) == sorted(_tensors())


def test_index_naming_a_missing_shard(tmp_path):
    _write_sharded(tmp_path, _tensors())
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(WeightLoadError, match="model-00002-of-00002.safetensors"):
        list(iter_safetensors(tmp_path, progress=False))


def test_no_safetensors_names_what_is_there(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    (tmp_path / "model-q4.gguf").write_bytes(b"x")
    with pytest.raises(WeightLoadError) as err:
        list(iter_safetensors(tmp_path, progress=False))
    message = str(err.value)
    assert str(tmp_path) in message and "pytorch_model.bin" in message and "model-q4.gguf" in message


def test_load_model_weights_fills_every_parameter(tmp_path):
    tensors = _tensors()
    _write_sharded(tmp_path, tensors)
    model = TinyModel()
    load_model_weights(model, tmp_path, progress=False)
    assert torch.equal(model.proj.bias, tensors["model.proj.bias"])
    assert torch.equal(model.head.weight, tensors["model.embed.weight"])


def test_unfilled_parameter_is_listed(tmp_path):
    tensors = _tensors()
    del tensors["model.proj.bias"]
    _write_sharded(tmp_path, tensors)
    with pytest.raises(WeightLoadError) as err:
        load_model_weights(TinyModel(), tmp_path, progress=False)
    assert "proj.bias" in str(err.value) and "inv_freq" not in str(err.value)


def test_unknown_checkpoint_tensor_is_an_error(tmp_path):
    tensors = {**_tensors(), "model.vision.weight": torch.zeros(2)}
    _write_sharded(tmp_path, tensors)
    with pytest.raises(WeightLoadError, match="model.vision.weight"):
        load_model_weights(TinyModel(), tmp_path, progress=False)
