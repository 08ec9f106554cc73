"""The plugin as armillary discovers it: entry point, registered records, config checks."""
from __future__ import annotations

import json
from importlib.metadata import entry_points

import pytest
import torch

from armillary.hf_config import HFConfig
from armillary.registry import PluginRegistry
from armillary_glm_flash import hooks
from armillary_glm_flash.config import GlmFlashConfig
from armillary_glm_flash.model import Glm4MoeLiteForCausalLM


def test_entry_point_names_the_hooks_module():
    found = [ep for ep in entry_points(group="armillary") if ep.name == "glm_flash"]
    assert [ep.value for ep in found] == ["armillary_glm_flash.hooks"]


def test_registered_records():
    registry = PluginRegistry()
    registry.register(hooks, "glm_flash")
    spec = registry.architectures.for_hf_architecture("Glm4MoeLiteForCausalLM")
    assert spec.load() is Glm4MoeLiteForCausalLM
    kernels = {k.name: k for k in registry.kernels if k.plugin == "glm_flash"}
    assert set(kernels) == {"torch_mla_decode", "triton_mla_decode"}
    assert all(k.interface == "mla_decode" for k in kernels.values())


def test_published_config_defaults_and_refusals():
    """GLM-4.7-Flash's shape from transformers' defaults; what the model cannot serve fails with the field named."""
    from transformers import Glm4MoeLiteConfig

    cfg = GlmFlashConfig.from_hf(HFConfig(json.loads(Glm4MoeLiteConfig().to_json_string())))
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim) == (47, 20, 512, 64)
    assert cfg.mlp_layer_types[:2] == ("dense", "sparse") and cfg.softmax_scale == 256 ** -0.5
    layout = Glm4MoeLiteForCausalLM.cache_layout(HFConfig(json.loads(Glm4MoeLiteConfig().to_json_string())))
    assert layout[0].bytes_per_token(torch.bfloat16) == 576 * 2
    with pytest.raises(ValueError, match="rope type"):
        GlmFlashConfig.from_hf(HFConfig({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1.0}}))
    with pytest.raises(ValueError, match="num_key_value_heads"):
        GlmFlashConfig.from_hf(HFConfig({"num_attention_heads": 20, "num_key_value_heads": 4}))
