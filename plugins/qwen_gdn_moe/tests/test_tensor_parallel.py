"""Qwen3-Next / Qwen3.5 over two and four ranks on the CPU (gloo, one process per rank) against transformers: tensor
parallelism (the Gated DeltaNet heads, conv channels and states, the attention heads and the expert widths split),
expert parallelism (1 / ep of the experts, whole, per rank) and both over the same ranks; greedy tokens identical
and logits close over 32 steps, one prompt at a time and all at once; fused and separate shared experts, a dense
MLP; rank 0 holds its share of each. MTP speculation (K = 2) over two ranks equals one process without it, through
the checkpoint's head and through oracle drafts on rank 0 that make every accepted length happen."""
from __future__ import annotations

import pytest

from armillary import LLM
from armillary.sampling_params import SamplingParams
from armillary.testing import assert_reference_run, lazy_references
from plugins.qwen_gdn_moe.tests.harness import build_engine, qwen_registry
from plugins.qwen_gdn_moe.tests.hf_models import CASES_BY_NAME, VOCAB, Case, make_reference, prompts
from plugins.qwen_gdn_moe.tests.mtp_checkpoint import save_with_mtp
from tests.fixtures.engine_runs import run_to_completion
from tests.fixtures.oracle_drafts import use_oracle_drafts

# the cases whose head counts and widths split in two: separate and fused shared experts, dense MLPs, a tied head
# with one (replicated) key-value head
TP_CASES = ("next_full_last", "moe35_cg", "moe35_causal", "dense35_causal", "dense35_cg_tied")
# four of everything that splits (GDN key and value heads, attention heads, experts; two kv heads, replicated at four
# ranks): next_full_last with wider GDN and MoE layers
FOUR = Case("next_four_ranks", "next", dict(CASES_BY_NAME["next_full_last"].text, linear_num_key_heads=4,
                                             linear_num_value_heads=8, linear_value_head_dim=16, num_experts=8))
# (case, tp, ep): every case at TP 2; the MoE cases at EP 2 and at TP 2 with EP 2 as well; four ranks: TP 4,
# EP 4 (two whole experts a rank) and both over the same four
RUNS = [(CASES_BY_NAME[name], tp, ep) for name in TP_CASES for tp, ep in ((2, 1), (1, 2), (2, 2))
        if ep == 1 or CASES_BY_NAME[name].is_moe]
RUNS += [(FOUR, 4, 1), (FOUR, 4, 4), (CASES_BY_NAME["moe35_cg"], 1, 4)]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return lazy_references(make_reference, tmp_path_factory)


@pytest.mark.parametrize("case,tp,ep", RUNS, ids=[f"{c.name}-tp{tp}-ep{ep}" for c, tp, ep in RUNS])
def test_ranks_match_transformers(references, case, tp, ep):
    reference = references(case)
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
        assert_reference_run(llm, reference, 32)
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("oracle", [False, True], ids=["mtp", "oracle"])
def test_mtp_speculation_over_two_ranks_equals_no_speculation(tmp_path, oracle):
    """Drafts, the verify step and the committed GDN states on both ranks in lockstep: rank 1 verifies rank 0's drafts
    against the same gathered logits, and the plan commits the state rows rank 0 accepted."""
    model_dir = save_with_mtp(CASES_BY_NAME["moe35_cg"], tmp_path)
    work = [(p, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)) for p in prompts()]
    args = dict(block_size=8, num_kv_blocks=128, max_num_seqs=8, distributed_timeout_s=60)
    base = run_to_completion(build_engine(model_dir, **args), work)
    engine = build_engine(model_dir, **args, tensor_parallel_size=2, speculative=True, num_drafts=2)
    try:
        lengths = use_oracle_drafts(engine, prompts(), base, VOCAB) if oracle else None
        assert run_to_completion(engine, work) == base
        assert engine.stats()["num_verify_steps"] > 0
        if oracle:
            assert set(lengths) == {0, 1, 2}, lengths
        engine.cache.check_accounting([])
    finally:
        engine.shutdown()
