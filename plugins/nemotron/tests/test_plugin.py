"""The plugin as armillary discovers it: entry point, architecture, parsers, kernels, tuning tables; config errors."""
from __future__ import annotations

import pytest

from armillary.hf_config import HFConfig
from armillary.kernels.tuning import kernel_config
from armillary.registry import PluginRegistry
from armillary_nemotron.config import NemotronHArgs, layer_kinds
from armillary_nemotron.model import NemotronHForCausalLM


def test_entry_point_registers_architecture_parsers_and_kernels(monkeypatch):
    monkeypatch.delenv("ARMILLARY_DISABLE_PLUGINS", raising=False)
    registry = PluginRegistry()
    registry.load_entry_points()
    info = registry.infos["nemotron"]
    assert info.distribution == "armillary-nemotron" and info.architectures == ["nemotron_h"]
    arch = registry.resolve_architecture(["NemotronHForCausalLM"])
    assert arch.load() is NemotronHForCausalLM
    assert registry.parsers.get("nano_v3").kind == "reasoning"
    names = {k.name for k in registry.kernels.for_interface("mamba_ssd_scan")}
    assert names == {"torch_mamba_ssd_scan", "triton_mamba_ssd_scan"}
    for spec in registry.kernels.for_interface("mamba_decode"):
        assert callable(spec.load())


def test_tuning_tables_are_read_for_sm_90():
    import torch

    cfg = kernel_config("armillary_nemotron", "mamba_ssd_scan", "default", {"CHUNK": 0}, torch.device("cpu"))
    assert cfg["CHUNK"] == 0  # the CPU reads no GPU table
    from armillary.kernels import tuning

    table = tuning.load_table("armillary_nemotron", "sm_90")
    assert {"mamba_ssd_scan", "mamba_decode"} <= set(table)


def _hf(**kw) -> HFConfig:
    base = dict(vocab_size=16, hidden_size=8, num_attention_heads=2, mamba_num_heads=2, mamba_head_dim=4,
                ssm_state_size=4, n_groups=1, n_routed_experts=4, num_experts_per_tok=1, moe_intermediate_size=4,
                moe_shared_expert_intermediate_size=4)
    return HFConfig({**base, **kw})


def test_layer_pattern_spellings_and_errors():
    assert layer_kinds(_hf(hybrid_override_pattern="M*E-")) == ["mamba", "attention", "moe", "mlp"]
    listed = layer_kinds(_hf(layers_block_type=["linear_attention", "full_attention", "moe", "mlp"]))
    assert listed == ["mamba", "attention", "moe", "mlp"]
    with pytest.raises(ValueError, match="unknown layer letters"):
        layer_kinds(_hf(hybrid_override_pattern="MX"))
    with pytest.raises(ValueError, match="moe_latent_size"):
        NemotronHArgs.parse(_hf(hybrid_override_pattern="ME", moe_latent_size=4))
    with pytest.raises(ValueError, match="n_group"):
        NemotronHArgs.parse(_hf(hybrid_override_pattern="ME", n_group=3))
    args = NemotronHArgs.parse(_hf(hybrid_override_pattern="ME", mamba_d_conv=3, mamba_chunk_size=16))
    assert (args.conv_kernel, args.chunk_size) == (3, 16)  # the legacy mamba_* names
