"""Qwen3.5 / Qwen3.6 text models: MoE (``qwen3_5_moe``) and dense (``qwen3_5``).

They serve both the multimodal ``...ForConditionalGeneration`` checkpoints (text sub-config, weights
under ``model.language_model.*``, vision tower skipped) and text-only ``...ForCausalLM`` ones.
"""
from __future__ import annotations

from armillary.hf_config import HFConfig
from armillary_qwen_gdn_moe.config import (
    QWEN3_5_DENSE_DEFAULTS,
    QWEN3_5_MOE_DEFAULTS,
    QwenHybridConfig,
    parse_config,
)
from armillary_qwen_gdn_moe.model import QwenHybridForCausalLM


class Qwen3_5MoeForCausalLM(QwenHybridForCausalLM):
    @classmethod
    def parse(cls, hf_config: HFConfig) -> QwenHybridConfig:
        return parse_config(hf_config, cls.text_config(hf_config), QWEN3_5_MOE_DEFAULTS, dense_rule="all_moe")


class Qwen3_5ForCausalLM(QwenHybridForCausalLM):
    @classmethod
    def parse(cls, hf_config: HFConfig) -> QwenHybridConfig:
        return parse_config(hf_config, cls.text_config(hf_config), QWEN3_5_DENSE_DEFAULTS, dense_rule="all_dense")
