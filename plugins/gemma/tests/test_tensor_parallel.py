"""Gemma 3 / Gemma 4 over two and four ranks on the CPU (gloo, one process per rank) against transformers: tensor
parallelism (heads, MLP and expert widths, the tied head's vocabulary rows split), expert parallelism on the MoE
model, both over the same ranks; greedy tokens and top-5 log-probabilities for 32 steps on three prompts at once. A
config whose k = v global heads cannot split is refused at build."""
from __future__ import annotations

import pytest

from armillary import LLM
from armillary.testing import assert_greedy_matches
from plugins.gemma.tests.gemma_hf import BLOCK, prompts

RUNS = [("gemma3", 2, 1), ("gemma3_softcap", 2, 1), ("gemma4_moe", 2, 1), ("gemma4_moe", 1, 2), ("gemma4_moe", 2, 2),
        ("gemma3", 4, 1), ("gemma4_moe", 4, 4)]  # four ranks: one head each, the two kv heads replicated


def _llm(directory, registry, tp: int, ep: int) -> LLM:
    return LLM(model=str(directory), registry=registry, dtype="float32", block_size=BLOCK, max_num_seqs=4,
               max_model_len=128, cpu_kv_cache_space_gb=0.05, tensor_parallel_size=tp, expert_parallel_size=ep,
               distributed_timeout_s=60)


@pytest.mark.parametrize("name,tp,ep", RUNS, ids=[f"{n}-tp{tp}-ep{ep}" for n, tp, ep in RUNS])
def test_ranks_match_transformers(name, tp, ep, tiny_gemma, gemma_registry):
    directory, hf_model = tiny_gemma(name)
    llm = _llm(directory, gemma_registry, tp, ep)
    try:
        model = llm.engine.model
        attn = model.model.layers[0].self_attn
        assert attn.num_heads == hf_model.config.num_attention_heads // tp  # rank 0's heads
        assert model.model.embed_tokens.weight.shape[0] == -(-hf_model.config.vocab_size // tp)
        assert_greedy_matches(llm, hf_model, prompts(), new_tokens=32, atol=1e-4)
    finally:
        llm.engine.shutdown()


def test_unsplittable_global_heads_are_refused(tiny_gemma, gemma_registry):
    directory, _ = tiny_gemma("gemma4_dense")  # one k = v global head
    with pytest.raises(Exception, match="kv heads with attention_k_eq_v do not split over tp 2"):
        _llm(directory, gemma_registry, 2, 1)
