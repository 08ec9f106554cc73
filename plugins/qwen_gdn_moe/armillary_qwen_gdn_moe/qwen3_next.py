"""Qwen3-Next (``qwen3_next``): GDN + gated attention, MoE layers (dense where ``mlp_only_layers`` says)."""
from __future__ import annotations

from armillary.hf_config import HFConfig
from armillary_qwen_gdn_moe.config import QWEN3_NEXT_DEFAULTS, QwenHybridConfig, parse_config
from armillary_qwen_gdn_moe.model import QwenHybridForCausalLM


class Qwen3NextForCausalLM(QwenHybridForCausalLM):
    @classmethod
    def parse(cls, hf_config: HFConfig) -> QwenHybridConfig:
        return parse_config(hf_config, cls.text_config(hf_config), QWEN3_NEXT_DEFAULTS, dense_rule="qwen3_next")
