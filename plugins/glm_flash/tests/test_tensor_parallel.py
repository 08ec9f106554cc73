"""GLM-4.7-Flash (glm4_moe_lite) over two and four ranks on the CPU (gloo, one process per rank) against
transformers: tensor parallelism (MLA heads through q_b / kv_b / o_proj, dense MLP and expert widths, vocabulary rows
split; the down-projections, the router and the whole latent cache on every rank), expert parallelism (half the
routed experts, whole, per rank) and both over the same two ranks; greedy tokens identical and logits close over 32
steps, one prompt at a time and all at once; rank 0 holds only its shard; MTP speculation (K = 2) over two ranks
equals one process without it. Without processes: heads that do not split are refused."""
from __future__ import annotations

import pytest
import torch

from armillary import LLM
from armillary.hf_config import HFConfig
from armillary.parallel import ParallelContext, use_parallel
from armillary.sampling_params import SamplingParams
from armillary.testing import assert_reference_run, lazy_references
from armillary_glm_flash.model import Glm4MoeLiteForCausalLM
from plugins.glm_flash.tests.harness import build_engine, glm_registry
from plugins.glm_flash.tests.hf_models import CASES_BY_NAME, NEW_TOKENS, Case, make_reference, prompts
from plugins.glm_flash.tests.test_mtp import write_mtp_checkpoint
from tests.fixtures.engine_runs import run_to_completion

# the plugin's cases with four heads (three do not split in two): q_lora_rank with a fused down-projection, one shared
# expert and a dense first layer; a full-rank q_proj, two shared experts, yarn and a tied head over an odd vocabulary
_FOUR_HEADS = dict(num_attention_heads=4, num_key_value_heads=4)
LORA = Case("tp_lora", dict(CASES_BY_NAME["lora_interleaved"].config, **_FOUR_HEADS))
TIED = Case("tp_q_proj_tied", dict(CASES_BY_NAME["yarn_two_shared"].config, **_FOUR_HEADS, vocab_size=301))
# (case, tp, ep): CPU time matters (every run spawns a rank), so the second case runs at TP 2 only
RUNS = [(LORA, 2, 1), (LORA, 1, 2), (LORA, 2, 2), (TIED, 2, 1), (LORA, 4, 1)]  # four ranks: one head each


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return lazy_references(make_reference, tmp_path_factory)


def assert_rank0_shard(model: Glm4MoeLiteForCausalLM, cfg: dict, tp: int, ep: int, caches: list) -> None:
    """Rank 0 keeps 1 / tp of the heads and widths (whole experts under EP), the whole latent and down-projections."""
    heads, nope, rope, v = (cfg[k] for k in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim",
                                             "v_head_dim"))
    lora, hidden = cfg["kv_lora_rank"], cfg["hidden_size"]
    layers = model.model.layers
    attn = layers[0].self_attn
    assert attn.num_heads == heads // tp
    q_up = attn.q_proj if cfg["q_lora_rank"] is None else attn.q_b_proj
    assert q_up.weight.shape[0] == heads // tp * (nope + rope)
    assert attn.kv_b_proj.weight.shape == (heads // tp * (nope + v), lora)
    assert attn.o_proj.weight.shape == (hidden, heads // tp * v)
    w_uk, w_uv = attn.absorbed_weights()  # the local heads' pieces of kv_b_proj
    assert w_uk.shape == (heads // tp, nope, lora) and w_uv.shape == (heads // tp, v, lora)
    if cfg["q_lora_rank"] is None:
        assert attn.kv_a_proj_with_mqa.weight.shape == (lora + rope, hidden)
    else:  # replicated: [q_a_proj | kv_a_proj_with_mqa] whole
        assert attn.qkv_a_proj.weight.shape == (cfg["q_lora_rank"] + lora + rope, hidden)
    assert all(c.kv.shape[-1] == lora + rope for c in caches)  # the latent is not split by heads
    dense = next(layer.mlp for layer in layers if hasattr(layer.mlp, "gate_up_proj"))
    assert dense.gate_up_proj.weight.shape[0] == 2 * cfg["intermediate_size"] // tp
    moe = next(layer.mlp for layer in layers if hasattr(layer.mlp, "experts"))
    assert moe.gate.weight.shape == (cfg["n_routed_experts"], hidden)  # the router replicated
    experts = moe.experts
    routed = [e for e in experts.local_experts if e < cfg["n_routed_experts"]]
    assert routed == list(range(cfg["n_routed_experts"] // ep))
    assert len(experts.local_experts) - len(routed) == cfg["n_shared_experts"]  # the shared ones live on rank 0
    assert experts.intermediate_size_per_partition == cfg["moe_intermediate_size"] // (tp if ep == 1 else 1)
    assert model.model.embed_tokens.weight.shape[0] == -(-cfg["vocab_size"] // tp)


@pytest.mark.parametrize("case,tp,ep", RUNS, ids=[f"{c.name}-tp{tp}-ep{ep}" for c, tp, ep in RUNS])
def test_ranks_match_transformers(references, case, tp, ep):
    reference = references(case)
    llm = LLM(str(reference.model_dir), registry=glm_registry(), dtype="float32", device="cpu", max_model_len=256,
              block_size=8, max_num_seqs=4, tensor_parallel_size=tp, expert_parallel_size=ep,
              distributed_timeout_s=60, cpu_kv_cache_space_gb=0.05)
    try:
        model = llm.engine.model
        assert_rank0_shard(model, case.config, tp, ep, llm.engine.worker.caches)
        assert_reference_run(llm, reference, NEW_TOKENS)
    finally:
        llm.engine.shutdown()


def _build_rank0(config: dict, tp: int, ep: int = 1) -> Glm4MoeLiteForCausalLM:
    """Rank 0's model built on the meta device (shapes only: construction runs no collective)."""
    ctx = ParallelContext(world_size=max(tp, ep), tp_size=tp, ep_size=ep)
    with use_parallel(ctx), torch.device("meta"):
        return Glm4MoeLiteForCausalLM(HFConfig({"model_type": "glm4_moe_lite", **config}))


def test_heads_that_do_not_split_are_refused():
    three_heads = CASES_BY_NAME["lora_interleaved"].config
    with pytest.raises(ValueError, match="3 MLA attention heads do not split over tensor-parallel size 2"):
        _build_rank0(three_heads, tp=2)
    _build_rank0(three_heads, tp=1, ep=2)  # attention stays whole under expert parallelism alone


def test_mtp_speculation_over_two_ranks_equals_no_speculation(tmp_path):
    """The MTP layer's heads split like the model's; its drafts and the verify step run on both ranks in lockstep."""
    write_mtp_checkpoint(tmp_path, **_FOUR_HEADS)
    work = [(p, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)) for p in prompts()]
    args = dict(block_size=8, num_kv_blocks=128, max_num_seqs=8, distributed_timeout_s=60)
    base = run_to_completion(build_engine(tmp_path, **args), work)
    engine = build_engine(tmp_path, **args, tensor_parallel_size=2, speculative=True, num_drafts=2)
    try:
        assert engine.model.mtp is not None and engine.model.mtp.self_attn.num_heads == 2
        assert run_to_completion(engine, work) == base
        assert engine.stats()["num_verify_steps"] > 0
    finally:
        engine.shutdown()
