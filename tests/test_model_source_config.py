"""``EngineConfig`` overrides on a model source: --download-dir, --generation-config, --chat-template, --tokenizer."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from armillary.chat_template import ChatTemplateError, load_chat_template
from armillary.config import EngineConfig
from armillary.errors import ModelNotFoundError
from armillary.model_source import ConfiguredSource, HFDirectory, open_model_source
from armillary.registry import PluginRegistry

COMMIT = "0123456789abcdef0123456789abcdef01234567"
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"


def _checkpoint(directory: Path, tok_dir: Path, **generation) -> Path:
    shutil.copytree(tok_dir, directory, dirs_exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"architectures": ["Qwen3NextForCausalLM"]}))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, **generation}))
    return directory


def _in_cache(cache: Path, repo_id: str, tok_dir: Path) -> Path:
    """``models--org--name`` as huggingface_hub lays out a downloaded snapshot."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    _checkpoint(repo / "snapshots" / COMMIT, tok_dir, temperature=0.7)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return repo / "snapshots" / COMMIT


def test_download_dir_is_the_cache_looked_in(tmp_path, tok_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "env-cache"))  # the flag wins over the environment
    monkeypatch.chdir(tmp_path)
    snapshot = _in_cache(tmp_path / "models", "org/tiny", tok_dir)
    reg = PluginRegistry()
    with pytest.raises(ModelNotFoundError, match="env-cache"):
        open_model_source("org/tiny", None, reg)
    source = open_model_source("org/tiny", None, reg, EngineConfig("org/tiny", download_dir=str(tmp_path / "models")))
    assert isinstance(source, ConfiguredSource) and isinstance(source.inner, HFDirectory)
    assert source.path == snapshot.resolve()
    # --tokenizer as a repo id is looked up in the same cache
    other = EngineConfig(str(snapshot), tokenizer="org/tiny", download_dir=str(tmp_path / "models"))
    assert open_model_source(str(snapshot), None, reg, other).tokenizer().name_or_path == str(snapshot.resolve())
    with pytest.raises(ModelNotFoundError, match="--download-dir"):
        open_model_source("org/other", None, reg, EngineConfig("org/other", download_dir=str(tmp_path / "models")))


def test_generation_config_auto_vllm_and_folder(tmp_path, tok_dir):
    model = _checkpoint(tmp_path / "model", tok_dir, temperature=0.6, top_k=20)
    folder = tmp_path / "gen"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 1.3, "eos_token_id": [5, 6]}))
    reg = PluginRegistry()

    def defaults(choice: str) -> dict:
        return open_model_source(str(model), None, reg, EngineConfig(str(model), generation_config=choice)
                                 ).generation_defaults()

    assert defaults("auto") == {"temperature": 0.6, "top_k": 20, "eos_token_id": [2]}
    assert defaults("vllm") == {"eos_token_id": [2]}
    assert defaults(str(folder)) == {"temperature": 1.3, "eos_token_id": [5, 6]}
    EngineConfig(str(model), generation_config=str(folder)).validate()
    with pytest.raises(ValueError, match="generation_config"):
        EngineConfig(str(model), generation_config=str(tmp_path)).validate()


def test_chat_template_override_from_file_or_inline(tmp_path, tok_dir):
    model = _checkpoint(tmp_path / "model", tok_dir)
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    reg = PluginRegistry()
    messages = [{"role": "user", "content": "hi"}]
    plain = open_model_source(str(model), None, reg, EngineConfig(str(model))).tokenizer()
    assert plain.apply_chat_template(messages) != "<user>hi"  # the checkpoint's own template
    for given in (str(tmp_path / "t.jinja"), TEMPLATE):
        tok = open_model_source(str(model), None, reg, EngineConfig(str(model), chat_template=given)).tokenizer()
        assert tok.apply_chat_template(messages) == "<user>hi"
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        assert tok.apply_chat_template(messages, tools=tools) == "<user>hi"  # the override wins with tools too


def test_load_chat_template_errors(tmp_path):
    assert load_chat_template("{{ messages }}") == "{{ messages }}"
    with pytest.raises(ChatTemplateError, match="looks like a file path"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ChatTemplateError, match="does not compile"):
        load_chat_template("{% for %}")
