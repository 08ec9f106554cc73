"""The plugin as armillary discovers it: entry point, architectures (both checkpoint layouts), parsers,
kernels; and the config fields it refuses or defaults."""
from __future__ import annotations

import pytest

from armillary.hf_config import HFConfig
from armillary.registry import PluginRegistry
from armillary_gemma.config import GemmaArgs


def test_entry_point_registers_both_families_and_the_gemma4_parsers(monkeypatch):
    monkeypatch.delenv("ARMILLARY_DISABLE_PLUGINS", raising=False)
    registry = PluginRegistry()
    registry.load_entry_points()
    info = registry.infos["gemma"]
    assert (info.distribution, info.architectures) == ("armillary-gemma", ["gemma3", "gemma4"])
    for hf_arch, name in (("Gemma3ForCausalLM", "gemma3"), ("Gemma3ForConditionalGeneration", "gemma3"),
                          ("Gemma4ForCausalLM", "gemma4"), ("Gemma4ForConditionalGeneration", "gemma4")):
        assert registry.resolve_architecture([hf_arch]).name == name
    gemma4 = registry.resolve_architecture(["Gemma4ForCausalLM"])
    assert (gemma4.default_tool_parser, gemma4.default_reasoning_parser) == ("gemma4", "gemma4_thinking")
    assert registry.resolve_architecture(["Gemma3ForCausalLM"]).default_tool_parser is None
    assert {"gemma4", "gemma4_thinking"} <= set(info.parsers)
    assert {"triton_gelu_tanh_and_mul", "torch_gelu_tanh_and_mul", "triton_norm_add_norm", "triton_gemma4_layer_tail",
            "triton_gemma_gemv", "torch_gemma_gemv"} <= set(info.kernels)


def test_published_gemma3_config_defaults_and_pattern():
    """The 27B's text_config as published: old rope keys, no layer_types (pattern 6), qpas 168."""
    args = GemmaArgs.from_hf(HFConfig({"model_type": "gemma3", "text_config": {
        "model_type": "gemma3_text", "hidden_size": 5376, "num_hidden_layers": 62, "num_attention_heads": 32,
        "num_key_value_heads": 16, "head_dim": 128, "query_pre_attn_scalar": 168, "sliding_window": 1024,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "rope_theta": 1e6, "rope_local_base_freq": 1e4}}))
    assert args.version == 3 and args.vocab_size == 262_208 and args.scale == 168**-0.5
    assert [i for i, la in enumerate(args.layers) if la.window is None] == list(range(5, 62, 6))
    assert (args.rope["full_attention"].rope_type, args.rope["full_attention"].factor) == ("linear", 8.0)
    assert args.rope["sliding_attention"].theta == 1e4


def test_gemma4_forces_the_last_layer_global_and_refuses_bad_sharing():
    base = {"model_type": "gemma4_text", "num_hidden_layers": 4, "hidden_size_per_layer_input": 0,
            "layer_types": ["sliding_attention"] * 4}
    assert GemmaArgs.from_hf(HFConfig(base)).layers[-1].kind == "full_attention"
    with pytest.raises(ValueError, match="shares KV but no earlier layer"):
        GemmaArgs.from_hf(HFConfig({**base, "num_kv_shared_layers": 1,
                                    "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}))
    with pytest.raises(ValueError, match="bidirectional"):
        GemmaArgs.from_hf(HFConfig({**base, "use_bidirectional_attention": "all"}))
    assert GemmaArgs.from_hf(HFConfig({**base, "use_bidirectional_attention": "vision"})).version == 4
