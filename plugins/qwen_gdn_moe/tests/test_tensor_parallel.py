"""Qwen3-Next / Qwen3.5 over two ranks on the CPU (gloo, one process per rank) against transformers: tensor
parallelism (the Gated DeltaNet heads, conv channels and states, the attention heads and the expert widths split),
expert parallelism (half the experts, whole, per rank) and both over the same two ranks; greedy tokens identical
and logits close over 32 steps, one prompt at a time and all at once; fused and separate shared experts, a dense
MLP; rank 0 holds its share of each."""
from __future__ import annotations

import pytest
import torch

from armillary import LLM
from armillary.testing import LogitsRecorder, greedy_params
from plugins.qwen_gdn_moe.tests.harness import qwen_registry
from plugins.qwen_gdn_moe.tests.hf_models import CASES_BY_NAME, make_reference

# the cases whose head counts and widths split in two: separate and fused shared experts, dense MLPs, a tied head
# with one (replicated) key-value head
TP_CASES = ("next_full_last", "moe35_cg", "moe35_causal", "dense35_causal", "dense35_cg_tied")
# (case, tp, ep): every case at TP 2; the MoE cases at EP 2 and at TP 2 with EP 2 as well
RUNS = [(name, tp, ep) for name in TP_CASES for tp, ep in ((2, 1), (1, 2), (2, 2))
        if ep == 1 or CASES_BY_NAME[name].is_moe]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    made = {}

    def get(name: str):
        if name not in made:
            made[name] = make_reference(CASES_BY_NAME[name], tmp_path_factory.mktemp(name))
        return made[name]
    return get


@pytest.mark.parametrize("name,tp,ep", RUNS, ids=[f"{n}-tp{tp}-ep{ep}" for n, tp, ep in RUNS])
def test_two_ranks_match_transformers(references, name, tp, ep):
    reference = references(name)
    llm = LLM(str(reference.model_dir), registry=qwen_registry(), dtype="float32", device="cpu", max_model_len=256,
              tensor_parallel_size=tp, expert_parallel_size=ep, distributed_timeout_s=60, cpu_kv_cache_space_gb=0.05)
    try:
        model = llm.engine.model
        cfg = reference.case.text
        gdn = next(layer.linear_attn for layer in model.model.layers if hasattr(layer, "linear_attn"))
        assert (gdn.num_k_heads, gdn.num_v_heads) == (cfg["linear_num_key_heads"] // tp,
                                                      cfg["linear_num_value_heads"] // tp)
        if reference.case.is_moe:  # EP: half the routed experts, whole; else every expert, 1 / tp of its width
            experts = next(layer.mlp.experts for layer in model.model.layers if hasattr(layer.mlp, "experts"))
            routed = [e for e in experts.local_experts if e < cfg["num_experts"]]
            assert len(routed) == cfg["num_experts"] // ep
            assert experts.intermediate_size_per_partition == cfg["moe_intermediate_size"] // (tp if ep == 1 else 1)
        assert gdn.conv1d.weight.shape[0] == gdn.conv_dim and gdn.A_log.shape == (gdn.num_v_heads,)
        assert model.model.embed_tokens.weight.shape[0] == -(-model.config.vocab_size // tp)  # vocabulary rows
        states = next(c for c in llm.engine.worker.caches if hasattr(c, "tensors")).tensors
        assert states[0].shape[1] == gdn.conv_dim and states[1].shape[1] == gdn.num_v_heads  # rank 0's share
        batch = llm.generate([{"prompt_token_ids": p} for p in reference.prompts], greedy_params(32))
        rec = LogitsRecorder(model)
        for prompt, tokens, logits in zip(reference.prompts, reference.tokens, reference.logits):
            rec.rows.clear()
            assert llm.generate({"prompt_token_ids": prompt}, greedy_params(32))[0].outputs[0].token_ids == tokens
            ours = torch.stack(rec.rows)
            err = (ours - logits).abs().max() / logits.abs().max()
            assert err < 1e-4, f"relative logits error {err:.2e}"
    finally:
        llm.engine.shutdown()
    assert [o.outputs[0].token_ids for o in batch] == reference.tokens  # all four prompts in one batch
