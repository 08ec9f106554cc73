"""NVFP4 quantization configs without a model: what ModelOpt and compressed-tensors configs say, exclusion and per-module formats, hf_quant_config.json detection, the parameters the methods register, and loading tensors stored beside a weight."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from armillary.errors import WeightLoadError
from armillary.hf_config import HFConfig
from armillary.layers import CheckpointLoader
from armillary.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear
from armillary.layers.moe import FusedMoE
from armillary.layers.quantization import resolve_quant_config, use_quant_config
from armillary.layers.quantization.compressed_tensors import CompressedTensorsConfig
from armillary.layers.quantization.modelopt import ModelOptConfig
from armillary.model_files import load_hf_config
from armillary.registry import PluginRegistry

NVFP4 = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}


def test_modelopt_config_both_spellings():
    nested = ModelOptConfig.from_config({"quant_method": "modelopt", "producer": {"name": "modelopt"},
                                         "quantization": {"quant_algo": "NVFP4", "group_size": 16,
                                                          "kv_cache_quant_algo": "FP8",
                                                          "exclude_modules": ["lm_head", "*mlp.gate"]}})
    flat = ModelOptConfig.from_config({"quant_method": "modelopt", "quant_algo": "nvfp4", "ignore": ["lm_head"],
                                       "kv_cache_scheme": {"type": "float", "num_bits": 8}})
    assert (nested.algo, nested.kv_cache_algo, nested.ignore) == ("NVFP4", "FP8", ("lm_head", "*mlp.gate"))
    assert (flat.algo, flat.kv_cache_algo) == ("NVFP4", "FP8")
    with pytest.raises(ValueError, match="group_size 32"):
        ModelOptConfig.from_config({"quant_algo": "NVFP4", "group_size": 32})
    with pytest.raises(ValueError, match="quant_algo 'INT4_AWQ'"):
        ModelOptConfig.from_config({"quant_algo": "INT4_AWQ"})
    with pytest.raises(ValueError, match="quantized_layers"):
        ModelOptConfig.from_config({"quant_algo": "MIXED_PRECISION"})
    with pytest.raises(ValueError, match=r"quantized_layers\['a.q_proj'\].quant_algo 'W8A8'"):
        ModelOptConfig.from_config({"quant_algo": "MIXED_PRECISION",
                                    "quantized_layers": {"a.q_proj": {"quant_algo": "W8A8"}}})


def test_modelopt_exclusion_wildcards_plain_entries_and_stacked_layers():
    cfg = ModelOptConfig("NVFP4", ("lm_head", "*mlp.gate", "model.layers.3.self_attn*", "*.1.self_attn.q_proj",
                                   "*.1.self_attn.k_proj", "*.1.self_attn.v_proj"))
    assert cfg.algo_of("lm_head") is None and cfg.algo_of("model.layers.0.mlp.gate") is None
    assert cfg.algo_of("model.layers.0.mlp.gate_up_proj") == "NVFP4"
    assert cfg.algo_of("model.layers.3.self_attn.qkv_proj") is None
    assert cfg.algo_of("model.language_model.layers.3.self_attn.o_proj") is None  # a multimodal checkpoint's path
    assert cfg.algo_of("model.layers.1.self_attn.qkv_proj") is None  # every checkpoint module of the stack excluded
    assert cfg.algo_of("model.layers.1.self_attn.o_proj") == "NVFP4"


def test_mixed_precision_picks_each_module_and_refuses_mixed_stacks():
    layers = {"model.language_model.layers.0.self_attn.q_proj": {"quant_algo": "FP8"},
              "model.language_model.layers.0.self_attn.k_proj": {"quant_algo": "FP8"},
              "model.language_model.layers.0.self_attn.v_proj": {"quant_algo": "FP8"},
              "model.language_model.layers.0.mlp.experts.0.gate_proj": {"quant_algo": "NVFP4", "group_size": 16},
              "model.language_model.layers.0.mlp.experts.0.down_proj": {"quant_algo": "NVFP4", "group_size": 16},
              "model.language_model.layers.1.self_attn.q_proj": {"quant_algo": "FP8"},
              "model.language_model.layers.1.self_attn.k_proj": {"quant_algo": "NVFP4"}}
    cfg = ModelOptConfig.from_config({"quant_algo": "MIXED_PRECISION", "quantized_layers": layers})
    assert cfg.algo_of("model.layers.0.self_attn.qkv_proj") == "FP8"
    assert cfg.algo_of("model.layers.0.mlp.experts") == "NVFP4"
    assert cfg.algo_of("model.layers.0.self_attn.o_proj") is None  # not listed: unquantized
    with pytest.raises(ValueError, match="model.layers.1.self_attn.qkv_proj: its checkpoint modules"):
        cfg.algo_of("model.layers.1.self_attn.qkv_proj")
    with pytest.raises(ValueError, match="without a prefix"):
        cfg.algo_of("")


def test_compressed_tensors_nvfp4_groups():
    base = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "ignore": ["lm_head"]}
    w4a4 = CompressedTensorsConfig.from_config({**base, "config_groups": {"g": {
        "targets": ["Linear"], "weights": NVFP4, "input_activations": {**NVFP4, "dynamic": "local"}}}})
    w4a16 = CompressedTensorsConfig.from_config({**base, "config_groups": {"g": {"targets": ["Linear"],
                                                                                "weights": NVFP4}}})
    assert w4a4.groups[0].nvfp4.input_scale == "input_global_scale" and w4a4.groups[0].nvfp4.global_reciprocal
    assert w4a16.groups[0].nvfp4.input_scale is None
    mixed = CompressedTensorsConfig.from_config({**base, "format": "mixed-precision", "config_groups": {
        "fp4": {"targets": [r"re:.*mlp.*"], "weights": NVFP4, "format": "nvfp4-pack-quantized"},
        "fp8": {"targets": ["Linear"], "format": "float-quantized", "weights": {
            "num_bits": 8, "type": "float", "strategy": "channel"},
            "input_activations": {"num_bits": 8, "type": "float", "dynamic": True}}}})
    assert [g.nvfp4 is not None for g in mixed.groups] == [True, False]
    with pytest.raises(ValueError, match="groups of 16"):
        CompressedTensorsConfig.from_config({**base, "config_groups": {"g": {"weights": {**NVFP4, "group_size": 32}}}})


def test_hf_quant_config_json_is_the_quantization_config_of_a_modelopt_export(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4", "exclude_modules": ["lm_head"]}}))
    cfg = resolve_quant_config(load_hf_config(tmp_path), PluginRegistry())
    assert isinstance(cfg, ModelOptConfig) and cfg.algo == "NVFP4" and cfg.ignore == ("lm_head",)
    own = {"quant_method": "modelopt", "quant_algo": "FP8"}  # config.json's own quantization_config wins
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["X"], "quantization_config": own}))
    assert resolve_quant_config(load_hf_config(tmp_path), PluginRegistry()).algo == "FP8"


def test_methods_register_the_checkpoints_names_and_refuse_odd_columns():
    with use_quant_config(ModelOptConfig("NVFP4")):
        qkv = QKVParallelLinear(32, 16, 2, 1, prefix="a.qkv_proj")
        experts = FusedMoE(4, 2, 32, 16, prefix="a.experts")
        with pytest.raises(ValueError, match="a.odd: 24 input columns"):
            ReplicatedLinear(24, 8, prefix="a.odd")
    shapes = {n: (tuple(p.shape), p.dtype) for n, p in qkv.named_parameters()}
    assert shapes == {"weight": ((64, 16), torch.uint8), "weight_scale": ((64, 2), torch.float8_e4m3fn),
                      "weight_scale_2": ((3,), torch.float32), "input_scale": ((3,), torch.float32)}
    assert {n: tuple(p.shape) for n, p in experts.named_parameters()} == {
        "gate_up_proj": (4, 32, 16), "down_proj": (4, 32, 8), "gate_up_proj_weight_scale": (4, 32, 2),
        "down_proj_weight_scale": (4, 32, 1), "gate_up_proj_weight_scale_2": (4, 2, 1),
        "down_proj_weight_scale_2": (4, 1), "gate_up_proj_input_scale": (4, 2, 1), "down_proj_input_scale": (4, 1)}
    with use_quant_config(ModelOptConfig("W4A16_NVFP4")):
        w4a16 = MergedColumnParallelLinear(32, [16, 16], prefix="a.gate_up_proj")
    assert sorted(n for n, _ in w4a16.named_parameters()) == ["weight", "weight_scale", "weight_scale_2"]


class _Block(nn.Module):
    """A module mapping only ``{a,b}_proj.weight`` onto the slots of one stacked layer (as plugins do)."""

    def __init__(self) -> None:
        super().__init__()
        with use_quant_config(ModelOptConfig("NVFP4")):
            self.ab = MergedColumnParallelLinear(32, [16, 8], prefix="block.ab")

    def checkpoint_pieces(self, local_name: str, tensor: torch.Tensor) -> list | None:
        proj, _, kind = local_name.partition(".")
        if proj not in ("a_proj", "b_proj") or kind != "weight":
            return None
        return [("ab.weight", tensor, {"shard_id": 0 if proj == "a_proj" else 1})]


def test_tensors_beside_a_weight_follow_it_and_per_tensor_values_wait_for_it():
    model = nn.Module()
    model.block = _Block()
    loader = CheckpointLoader(model)
    assert loader.load("block.a_proj.weight_scale_2", torch.tensor(2.0)) == []  # before its weight: waits
    assert loader.load("block.a_proj.weight", torch.zeros(16, 16, dtype=torch.uint8))
    assert model.block.ab.weight_scale_2[0].item() == 2.0  # flushed once the weight's slot was known
    assert loader.load("block.b_proj.weight", torch.zeros(8, 16, dtype=torch.uint8))
    assert loader.load("block.b_proj.weight_scale_2", torch.tensor([3.0]))  # after it: straight to slot 1
    assert loader.load("block.b_proj.weight_scale", torch.ones(8, 2).to(torch.float8_e4m3fn))  # rows: mapped as it
    assert model.block.ab.weight_scale_2.tolist() == [2.0, 3.0] and model.block.ab.weight_scale[16:].float().eq(1).all()
    assert loader.load("block.c_proj.weight_scale", torch.ones(8, 2)) is None  # nothing maps its weight
    loader.load("block.c_proj.input_scale", torch.tensor(1.0))
    with pytest.raises(WeightLoadError, match="block.c_proj.input_scale"):
        loader.loaded()


def test_quantization_flag_naming_the_checkpoint_format_only_checks_it():
    from armillary.config import EngineConfig
    from armillary.errors import PluginError

    hf = HFConfig({"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}})
    assert isinstance(resolve_quant_config(hf, PluginRegistry(), "modelopt_fp4"), ModelOptConfig)
    with pytest.raises(PluginError, match="--quantization compressed-tensors: .* is 'modelopt'"):
        resolve_quant_config(hf, PluginRegistry(), "compressed-tensors")
    EngineConfig(model="x", quantization="modelopt_fp4").validate()
    with pytest.raises(ValueError, match="modelopt_fp4"):
        EngineConfig(model="x", quantization="fp4").validate()
