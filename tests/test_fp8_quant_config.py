"""FP8 quantization configs: what they read from config.json, the skip lists, and the errors naming what is wrong."""
from __future__ import annotations

import pytest
import torch

from armillary.errors import PluginError, WeightLoadError
from armillary.hf_config import HFConfig
from armillary.layers import MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear
from armillary.layers.quantization import UnquantizedLinearMethod, resolve_quant_config, use_quant_config
from armillary.layers.quantization.compressed_tensors import CompressedTensorsConfig
from armillary.layers.quantization.fp8 import Fp8Config, OnlineFp8Config, skipped
from armillary.layers.quantization.fp8_methods import Fp8LinearMethod, OnlineFp8LinearMethod, fp8_slot_count
from armillary.registry import default_registry

FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


@pytest.mark.parametrize("key,value,match", [("fmt", "e5m2", "fmt"), ("activation_scheme", "static", "activation_scheme"),
                                             ("weight_block_size", None, "per-tensor")])
def test_fp8_config_refuses_what_it_cannot_serve(key, value, match):
    with pytest.raises(ValueError, match=match):
        Fp8Config.from_config({**FP8, key: value})


def test_registry_resolves_both_formats_and_online():
    reg = default_registry()
    cfg = resolve_quant_config(HFConfig({"quantization_config": FP8}), reg)
    assert isinstance(cfg, Fp8Config) and cfg.block == (128, 128)
    ct = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
          "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float",
                                                                     "strategy": "channel"},
                                  "input_activations": {"num_bits": 8, "type": "float", "dynamic": True}}}}
    assert isinstance(resolve_quant_config(HFConfig({"quantization_config": ct}), reg), CompressedTensorsConfig)
    online = resolve_quant_config(HFConfig({}), reg, "fp8_block")
    assert isinstance(online, OnlineFp8Config) and online.block == (128, 128)
    assert isinstance(resolve_quant_config(HFConfig({"quantization_config": FP8}), reg, "fp8"), Fp8Config)
    with pytest.raises(PluginError, match="already quantized as 'gptq'"):
        resolve_quant_config(HFConfig({"quantization_config": {"quant_method": "gptq"}}), reg, "fp8")
    with pytest.raises(ValueError, match="static input_scale"):
        CompressedTensorsConfig.from_config({**ct, "config_groups": {"g": {
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
            "input_activations": {"num_bits": 8, "type": "float", "dynamic": False}}}})


def test_skip_list_matching():
    ignore = ("lm_head", "model.language_model.layers.0.self_attn.q_proj", "model.language_model.layers.0.self_attn.k_proj",
              "model.language_model.layers.0.self_attn.v_proj", "re:.*linear_attn.*", "model.layers.2.mlp")
    assert skipped(ignore, "model.layers.0.self_attn.qkv_proj")  # every packed module listed
    assert skipped(ignore, "model.layers.5.linear_attn.in_proj")  # a regex over the checkpoint's spelling
    assert skipped(ignore, "model.layers.2.mlp.gate_up_proj")  # inside a listed module
    assert not skipped(ignore, "model.layers.1.self_attn.qkv_proj")
    with pytest.raises(ValueError, match=r"only \['q_proj'\]"):
        skipped(("model.layers.3.self_attn.q_proj",), "model.layers.3.self_attn.qkv_proj")


def test_layers_get_their_methods_and_tail_slots():
    assert fp8_slot_count([2048, 2048, 4096, 4096, 32, 32], 128) == 4  # GDN in_proj: b, a off the block grid
    assert fp8_slot_count([256, 100], 128) == 2  # a ragged last slot is fine
    cfg = Fp8Config((128, 128), ("lm_head", "model.head"))
    with use_quant_config(cfg):
        merged = MergedColumnParallelLinear(256, [256, 256, 32, 32], prefix="model.layers.0.linear_attn.in_proj")
        qkv = QKVParallelLinear(256, 128, 2, 1, prefix="model.layers.1.self_attn.qkv_proj")
        head = ReplicatedLinear(256, 10, prefix="model.head")
    assert isinstance(merged.quant_method, Fp8LinearMethod) and merged.fp8_rows == 512
    assert merged.weight_tail.shape == (64, 256) and merged.weight_scale_inv.shape == (4, 2)
    assert isinstance(qkv.quant_method, Fp8LinearMethod) and qkv.weight_scale_inv.shape == (4, 2)
    assert isinstance(head.quant_method, UnquantizedLinearMethod)
    with use_quant_config(OnlineFp8Config()):
        online = ReplicatedLinear(256, 10, prefix="x")
    assert isinstance(online.quant_method, OnlineFp8LinearMethod) and online.weight.dtype == torch.get_default_dtype()


def test_unquantized_tensor_into_fp8_rows_is_named():
    with use_quant_config(Fp8Config((128, 128))):
        layer = MergedColumnParallelLinear(256, [256, 256, 32, 32], prefix="model.layers.0.linear_attn.in_proj")
    with pytest.raises(WeightLoadError, match="in_proj.weight.*float32.*modules_to_not_convert"):
        layer.weight.weight_loader(layer.weight, torch.zeros(256, 256), 0)
    with pytest.raises(WeightLoadError, match="unquantized checkpoint tensor"):
        layer.weight.weight_loader(layer.weight, torch.zeros(32, 256).to(torch.float8_e4m3fn), 2)
    with pytest.raises(WeightLoadError, match=r"weight_scale_inv.*\(2, 2\)"):
        layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, torch.ones(2, 3), 0)
