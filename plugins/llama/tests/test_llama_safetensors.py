"""Plain safetensors ``LlamaForCausalLM`` checkpoints (tiny, random) through armillary's offline API,
against transformers: identical greedy tokens, close log-probabilities."""
from __future__ import annotations

import pytest
import torch

from armillary import LLM
from armillary.cache_spec import FullAttention
from armillary.errors import WeightLoadError
from armillary.hf_config import HFConfig
from armillary_llama.model import LlamaForCausalLM

CASES = {
    # GQA, untied head, Llama 3.1 RoPE with a short original context so the scaling bites
    "gqa_llama3_rope": dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5000.0, "factor": 8.0,
                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 32}),
    # plain multi-head attention, tied embeddings, biases everywhere, linear RoPE scaling
    "mha_tied_bias_linear_rope": dict(num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True,
                                      mlp_bias=True, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                                                      "factor": 2.0}),
}


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 19, 41)]


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_and_logprobs_match_transformers(case, tiny_llama, llama_registry, greedy_matches):
    directory, hf_model = tiny_llama(case, **CASES[case])
    # a 16-token step budget splits the longer prompts into chunked prefills mixed with decodes
    llm = LLM(model=str(directory), registry=llama_registry, dtype="float32", max_num_seqs=4,
              max_num_batched_tokens=16, cpu_kv_cache_space_gb=0.05)
    assert llm.engine.arch.name == "llama"
    greedy_matches(llm, hf_model, _prompts(hf_model.config.vocab_size), new_tokens=24, atol=1e-4)


def test_cache_layout_is_full_attention_per_layer():
    config = HFConfig({"vocab_size": 10, "hidden_size": 32, "intermediate_size": 8, "num_hidden_layers": 3,
                       "num_attention_heads": 4, "num_key_value_heads": 2})
    assert LlamaForCausalLM.cache_layout(config) == [FullAttention(kv_heads=2, head_dim=8)] * 3


def test_unknown_and_misshapen_tensors_are_named(tiny_llama):
    directory, _ = tiny_llama()
    model = LlamaForCausalLM(HFConfig.from_file(directory / "config.json"))
    with pytest.raises(WeightLoadError, match="'model.layers.0.self_attn.q_norm.weight' matches no parameter"):
        model.load_weights([("model.layers.0.self_attn.q_norm.weight", torch.zeros(16))])
    with pytest.raises(WeightLoadError, match=r"model.layers.1.mlp.up_proj.weight -> .*expects .*\(96, 64\).*got \(96, 63\)"):
        model.load_weights([("model.layers.1.mlp.up_proj.weight", torch.zeros(96, 63))])


def test_fused_projection_counts_as_filled_only_with_every_shard(tiny_llama):
    directory, hf_model = tiny_llama()
    model = LlamaForCausalLM(HFConfig.from_file(directory / "config.json"))
    state = hf_model.state_dict()
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"]
    assert model.load_weights((n, state[n]) for n in names) == set()
    filled = model.load_weights((n, state[n]) for n in [*names, "model.layers.0.self_attn.v_proj.weight"])
    assert filled == {"model.layers.0.self_attn.qkv_proj.weight"}
