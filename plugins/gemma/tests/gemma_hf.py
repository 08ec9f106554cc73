"""Tiny random Gemma 3 / Gemma 4 checkpoints saved by transformers, and transformers' greedy generations:
the oracle the gemma plugin's tests hold armillary to.

Windows are shorter than the prompts, both rope types are used, the final logits are soft-capped
hard enough to matter, and the norms / scalars are spread so that every weight shows.
"""
from __future__ import annotations

import torch

from armillary.testing import assert_greedy_matches, hf_greedy  # noqa: F401 - re-exported for this plugin's tests

WINDOW, BLOCK = 12, 4
LAYERS_8 = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
            "full_attention", "sliding_attention", "full_attention"]
LAYERS_6 = LAYERS_8[:6]
BASE = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6, sliding_window=WINDOW,
            final_logit_softcapping=3.0, pad_token_id=0, eos_token_id=1, bos_token_id=2)

GEMMA3 = dict(BASE, num_hidden_layers=6, layer_types=LAYERS_6, query_pre_attn_scalar=24,
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                               "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0}})
GEMMA3_SOFTCAP = dict(GEMMA3, attn_logit_softcapping=2.0)
_GEMMA4_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1_000_000.0}}
# dense with everything the small models have: k = v globals of their own width, KV sharing, per-layer inputs
GEMMA4_DENSE = dict(BASE, num_hidden_layers=8, layer_types=LAYERS_8, global_head_dim=32,
                    num_global_key_value_heads=1, attention_k_eq_v=True, num_kv_shared_layers=3,
                    use_double_wide_mlp=True, hidden_size_per_layer_input=8, vocab_size_per_layer_input=160,
                    rope_parameters=_GEMMA4_ROPE)
GEMMA4_MOE = dict(BASE, num_hidden_layers=6, layer_types=LAYERS_6, global_head_dim=32, enable_moe_block=True,
                  num_experts=4, top_k_experts=2, moe_intermediate_size=32, hidden_size_per_layer_input=0,
                  rope_parameters=_GEMMA4_ROPE)
CONFIGS = {"gemma3": GEMMA3, "gemma3_softcap": GEMMA3_SOFTCAP, "gemma4_dense": GEMMA4_DENSE,
           "gemma4_moe": GEMMA4_MOE}


def _softcapped_eager(module_globals: dict) -> None:
    """transformers' Gemma 3 never passes ``attn_logit_softcapping`` to its attention; this eager
    attention does (Gemma 2's and vLLM's reading), so the oracle applies what the config says."""
    eager = module_globals["eager_attention_forward"]
    if getattr(eager, "softcapped", False):
        return

    def forward(module, query, key, value, attention_mask, **kw):
        kw["softcap"] = module.config.attn_logit_softcapping
        return eager(module, query, key, value, attention_mask, **kw)

    forward.softcapped = True
    module_globals["eager_attention_forward"] = forward


def build_hf(name: str, seed: int = 0) -> torch.nn.Module:
    """A random transformers ``Gemma{3,4}ForCausalLM`` of config ``name`` with every weight mattering."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Gemma4ForCausalLM, Gemma4TextConfig

    torch.manual_seed(seed)
    gemma3 = name.startswith("gemma3")
    config = (Gemma3TextConfig if gemma3 else Gemma4TextConfig)(**CONFIGS[name])
    model = (Gemma3ForCausalLM if gemma3 else Gemma4ForCausalLM)(config).eval()
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if "norm" in pname:  # Gemma 3 stores (1 + w) offsets, Gemma 4 plain scales
                param.uniform_(-0.5, 0.5) if gemma3 else param.uniform_(0.5, 1.5)
            elif pname.endswith(("router.scale", "per_expert_scale")):
                param.uniform_(0.5, 1.5)
        for bname, buf in model.named_buffers():
            if bname.endswith("layer_scalar"):
                buf.uniform_(0.5, 1.5)
    if name == "gemma3_softcap":
        import transformers.models.gemma3.modeling_gemma3 as m

        model.set_attn_implementation("eager")
        _softcapped_eager(vars(m))
    return model


def prompts(lengths=(40, 43, 29), vocab: int = 160, seed: int = 3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]
