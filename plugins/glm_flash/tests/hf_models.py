"""Tiny random transformers ``glm4_moe_lite`` models saved as checkpoints, plus their greedy generations: the
reference the armillary model is held to (odd latent / rope / head sizes, dense-then-sparse layers)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers as tf

from armillary.testing import Reference, greedy_reference

VOCAB = 300
PROMPT_LENGTHS = (1, 9, 40, 100)
NEW_TOKENS = 32

# no EOS token: generate's min_new_tokens would mask it, so the raw logits' argmax could differ from its tokens
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=3, num_key_value_heads=3, initializer_range=0.08,
               intermediate_size=96, moe_intermediate_size=32, n_routed_experts=6, num_experts_per_tok=2,
               routed_scaling_factor=1.8, max_position_embeddings=512, pad_token_id=0, eos_token_id=None)


@dataclass(frozen=True)
class Case:
    name: str
    config: dict[str, Any]


CASES = [
    # q_lora_rank, interleaved rope, one shared expert, dense first layer
    Case("lora_interleaved", dict(_COMMON, num_hidden_layers=3, mlp_layer_types=["dense", "sparse", "sparse"],
                                  q_lora_rank=24, kv_lora_rank=40, qk_nope_head_dim=20, qk_rope_head_dim=12,
                                  v_head_dim=28, n_shared_experts=1, norm_topk_prob=True,
                                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # no q_lora_rank, neox rope, two shared experts, yarn with mscale_all_dim (softmax scale and cos/sin factor)
    Case("yarn_two_shared", dict(_COMMON, num_hidden_layers=3, mlp_layer_types=["dense", "dense", "sparse"],
                                 q_lora_rank=None, kv_lora_rank=36, qk_nope_head_dim=16, qk_rope_head_dim=10,
                                 v_head_dim=20, n_shared_experts=2, norm_topk_prob=False, rope_interleave=False,
                                 tie_word_embeddings=True,
                                 rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                  "original_max_position_embeddings": 128, "mscale": 1.0,
                                                  "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1})),
]
# group-limited routing: 8 experts in 4 groups, only the 2 best groups eligible (DeepSeek-V3 style)
GROUPED = Case("grouped_routing", dict(_COMMON, num_hidden_layers=2, mlp_layer_types=["sparse", "sparse"],
                                       q_lora_rank=20, kv_lora_rank=28, qk_nope_head_dim=12, qk_rope_head_dim=8,
                                       v_head_dim=16, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=3,
                                       n_group=4, topk_group=2,
                                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))
CASES_BY_NAME = {c.name: c for c in [*CASES, GROUPED]}


def build_hf_model(case: Case) -> tf.PreTrainedModel:
    """fp32, eager attention, seeded; norms and router biases spread so every weight matters."""
    torch.manual_seed(0)
    config = tf.Glm4MoeLiteConfig(**case.config)
    model = tf.Glm4MoeLiteForCausalLM._from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.3)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.05)
    return model


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1234)
    return [torch.randint(2, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def make_reference(case: Case, model_dir: Path) -> Reference:
    """The case's model saved to ``model_dir``, with its greedy continuation of each prompt."""
    return greedy_reference(build_hf_model(case), model_dir, prompts(), NEW_TOKENS, case=case)
