"""Tiny random transformers models of each served architecture, saved as checkpoints, plus their
greedy generations: the reference the armillary models are held to."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers as tf

from armillary.testing import Reference, greedy_reference, read_checkpoint, write_checkpoint  # noqa: F401 - re-exported for this plugin's tests

L, F = "linear_attention", "full_attention"
VOCAB = 300
PROMPT_LENGTHS = (1, 9, 64, 100)
NEW_TOKENS = 32


@dataclass(frozen=True)
class Case:
    """``kind``: next | moe_cg | moe_causal | dense_cg | dense_causal."""

    name: str
    kind: str
    text: dict[str, Any]
    tie: bool = False

    @property
    def is_moe(self) -> bool:
        return self.kind in ("next", "moe_cg", "moe_causal")

    @property
    def is_conditional_generation(self) -> bool:
        return self.kind.endswith("_cg")


def _rope(partial: float, mrope: list[int] | None = None) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial}
    if mrope is not None:
        params.update(mrope_section=mrope, mrope_interleaved=True)
    return params


_GDN_2_4 = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=24)
CASES = [
    Case("next_full_last", "next", dict(
        hidden_size=64, layer_types=[L, L, F], num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        **_GDN_2_4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, rope_parameters=_rope(0.25))),
    Case("next_full_first_dense_layer_tied", "next", dict(
        hidden_size=96, layer_types=[F, L, L, F], num_attention_heads=6, num_key_value_heads=1, head_dim=16,
        linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=24, linear_value_head_dim=16,
        num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24, shared_expert_intermediate_size=40,
        mlp_only_layers=[1], intermediate_size=80, norm_topk_prob=False, rope_parameters=_rope(0.5)), tie=True),
    Case("moe35_cg", "moe_cg", dict(
        hidden_size=64, layer_types=[L, F, L, F], num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        rope_parameters=_rope(0.25, [2, 1, 1]))),
    Case("moe35_causal", "moe_causal", dict(
        hidden_size=128, layer_types=[F, L], num_attention_heads=2, num_key_value_heads=2, head_dim=32,
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=16, linear_value_head_dim=16,
        num_experts=4, num_experts_per_tok=1, moe_intermediate_size=48, shared_expert_intermediate_size=64,
        rope_parameters=_rope(0.25, [2, 1, 1]))),
    Case("dense35_cg_tied", "dense_cg", dict(
        hidden_size=64, layer_types=[L, L, F], num_attention_heads=4, num_key_value_heads=1, head_dim=16,
        **_GDN_2_4, intermediate_size=128, rope_parameters=_rope(0.5, [2, 1, 1])), tie=True),
    Case("dense35_causal", "dense_causal", dict(
        hidden_size=64, layer_types=[L, F, L], num_attention_heads=2, num_key_value_heads=2, head_dim=32,
        **_GDN_2_4, intermediate_size=96, rope_parameters=_rope(0.25, [2, 1, 1]))),
]
CASES_BY_NAME = {c.name: c for c in CASES}
VISION = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, patch_size=4, num_position_embeddings=16)


def build_hf_model(case: Case) -> tf.PreTrainedModel:
    """fp32, eager attention, seeded; weights scaled up and norms perturbed so every part matters."""
    torch.manual_seed(0)
    text = dict(vocab_size=VOCAB, initializer_range=0.08, num_hidden_layers=len(case.text["layer_types"]), **case.text)
    hidden = text["hidden_size"]
    if case.kind == "next":
        config, cls = tf.Qwen3NextConfig(tie_word_embeddings=case.tie, **text), tf.Qwen3NextForCausalLM
    elif case.kind == "moe_causal":
        config, cls = tf.Qwen3_5MoeTextConfig(tie_word_embeddings=case.tie, **text), tf.Qwen3_5MoeForCausalLM
    elif case.kind == "dense_causal":
        config, cls = tf.Qwen3_5TextConfig(tie_word_embeddings=case.tie, **text), tf.Qwen3_5ForCausalLM
    elif case.kind == "moe_cg":
        config = tf.Qwen3_5MoeConfig(text_config=text, vision_config=dict(VISION, out_hidden_size=hidden),
                                     tie_word_embeddings=case.tie)
        cls = tf.Qwen3_5MoeForConditionalGeneration
    else:
        config = tf.Qwen3_5Config(text_config=text, vision_config=dict(VISION, out_hidden_size=hidden),
                                  tie_word_embeddings=case.tie)
        cls = tf.Qwen3_5ForConditionalGeneration
    model = cls._from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # zero-centred norms start at 0, gated norm at 1
                p.add_(torch.randn_like(p) * 0.3)
    return model


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1234)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def make_reference(case: Case, model_dir: Path) -> Reference:
    """The case's model saved to ``model_dir``, with its greedy continuation of each prompt."""
    return greedy_reference(build_hf_model(case), model_dir, prompts(), NEW_TOKENS, case=case)
