"""Tiny random transformers ``nemotron_h`` models (several layer patterns, group counts, chunk sizes
smaller than the prompts), saved as checkpoints, with their greedy generations: the reference."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers as tf

import armillary_nemotron.hooks as nemotron_hooks
from armillary.registry import PluginRegistry
from armillary.testing import Reference, greedy_reference, plugin_registry

VOCAB = 256
PROMPT_LENGTHS = (1, 9, 64, 100)
NEW_TOKENS = 32


@dataclass(frozen=True)
class Case:
    name: str
    config: dict[str, Any]


_BASE = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             intermediate_size=96, ssm_state_size=16, conv_kernel=4, n_routed_experts=8, moe_intermediate_size=32,
             max_position_embeddings=512, initializer_range=0.08, eos_token_id=None, bos_token_id=None,
             pad_token_id=0)
CASES = [
    # stacked shared expert (64 = 2 x 32), one router group, 2 Mamba groups, 8-token SSD chunks
    Case("ME*ME_groups2_chunk8", dict(_BASE, hybrid_override_pattern="ME*ME", mamba_num_heads=4, mamba_head_dim=16,
                                      n_groups=2, chunk_size=8, num_experts_per_tok=2,
                                      moe_shared_expert_intermediate_size=64, routed_scaling_factor=1.5)),
    # group-limited router (4 groups, best 2), a shared expert that cannot be stacked, a dense relu² layer
    Case("M*-EM_groups4_router_groups", dict(_BASE, hybrid_override_pattern="M*-EM", mamba_num_heads=8,
                                             mamba_head_dim=8, n_groups=4, chunk_size=16, num_experts_per_tok=3,
                                             n_group=4, topk_group=2, moe_shared_expert_intermediate_size=48,
                                             routed_scaling_factor=2.5)),
    # attention first, one Mamba group, no conv bias, tied embeddings, chunk 32
    Case("*MEM-_groups1_tied", dict(_BASE, hybrid_override_pattern="*MEM-", mamba_num_heads=2, mamba_head_dim=32,
                                    n_groups=1, chunk_size=32, num_experts_per_tok=2, use_conv_bias=False,
                                    moe_shared_expert_intermediate_size=32, tie_word_embeddings=True)),
]
CASES_BY_NAME = {c.name: c for c in CASES}


def nemotron_registry() -> PluginRegistry:
    return plugin_registry(nemotron_hooks, "nemotron")


def build_hf_model(case: Case) -> tf.PreTrainedModel:
    """fp32, eager attention, seeded; norms, SSM parameters and router bias perturbed so every part matters."""
    torch.manual_seed(0)
    config = tf.NemotronHConfig(**case.config)
    model = tf.NemotronHForCausalLM._from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.3)
            elif name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=gen) * 4 + 0.5))
            elif name.endswith(".D"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5 - 1.0)
            elif name.endswith("conv1d.bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
            elif name.endswith("out_proj.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * (0.5 / math.sqrt(p.shape[1])))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.05)
    return model


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1234)
    return [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def make_reference(case: Case, model_dir: Path, new_tokens: int = NEW_TOKENS) -> Reference:
    """The case's model saved to ``model_dir``, with its greedy continuation of each prompt."""
    return greedy_reference(build_hf_model(case), model_dir, prompts(), new_tokens, case=case)
