"""MTP speculative decoding on tiny hybrid (GDN + attention + MoE) models: greedy output with
speculation on equals it off for K = 1, 2, 3, through the checkpoint's own MTP head and through an
oracle drafter whose drafts are partly right (``tests/fixtures/oracle_drafts.py``), so every
accepted length 0..K occurs and the recurrent state is committed after each; concurrent requests,
forced preemption, the Triton path; every block, slot and state row accounted for afterwards."""
from __future__ import annotations

import pytest
import torch

from armillary.sampling_params import SamplingParams
from plugins.qwen_gdn_moe.tests.harness import build_engine
from plugins.qwen_gdn_moe.tests.hf_models import CASES_BY_NAME, VOCAB, prompts
from plugins.qwen_gdn_moe.tests.mtp_checkpoint import save_with_mtp
from tests.fixtures.engine_runs import run_to_completion
from tests.fixtures.oracle_drafts import OracleProposer, oracle_reference, use_oracle_drafts

NEW = 24


@pytest.fixture(scope="module", params=["next_full_last", "moe35_cg"])
def mtp_dir(request, tmp_path_factory):
    return save_with_mtp(CASES_BY_NAME[request.param], tmp_path_factory.mktemp(request.param))


def _greedy(n: int = NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _accounted(engine) -> None:
    engine.cache.check_accounting([])  # every block, slot and state row in exactly one place
    stats = engine.cache.stats()
    assert stats["kv_blocks_used"] == 0 and stats["state_slots_used"] == 0, stats
    assert engine.cache.pool.num_free + stats.get("kv_blocks_cached", 0) == engine.cache.pool.num_usable
    assert not engine.scheduler.running and not engine.scheduler.waiting


@pytest.mark.parametrize("k", [1, 2, 3])
def test_mtp_greedy_equals_no_speculation(mtp_dir, k):
    work = [(p, _greedy()) for p in prompts()]
    base = run_to_completion(build_engine(mtp_dir, block_size=8, num_kv_blocks=128, max_num_seqs=8), work)
    engine = build_engine(mtp_dir, block_size=8, num_kv_blocks=128, max_num_seqs=8, speculative=True, num_drafts=k)
    assert run_to_completion(engine, work) == base
    stats = engine.stats()
    assert stats["num_verify_steps"] > 0 and stats["num_draft_tokens"] > 0
    _accounted(engine)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_oracle_drafts_accept_every_length_and_equal_no_speculation(mtp_dir, k):
    ps = prompts()
    work = [(p, _greedy()) for p in ps]
    base = run_to_completion(build_engine(mtp_dir, block_size=8, num_kv_blocks=128, max_num_seqs=8), work)
    engine = build_engine(mtp_dir, block_size=8, num_kv_blocks=128, max_num_seqs=8, speculative=True, num_drafts=k)
    lengths = use_oracle_drafts(engine, ps, base, VOCAB)
    assert run_to_completion(engine, work) == base
    assert set(lengths) == set(range(k + 1)), lengths  # every accepted length happened
    assert engine.stats()["spec_tokens_per_step"] > 1.0
    _accounted(engine)


def test_concurrent_requests_with_forced_preemption(mtp_dir):
    gen = torch.Generator().manual_seed(5)
    ps = [torch.randint(0, VOCAB, (int(n),), generator=gen).tolist() for n in torch.randint(3, 40, (8,), generator=gen)]
    work = [(p, _greedy(20)) for p in ps]
    base = run_to_completion(build_engine(mtp_dir, block_size=8, num_kv_blocks=128, max_num_seqs=8), work)
    engine = build_engine(mtp_dir, block_size=8, num_kv_blocks=24, max_num_seqs=8, speculative=True, num_drafts=2)
    runner = engine.runner
    runner.proposer = OracleProposer(runner.proposer, oracle_reference(ps, base), VOCAB)
    assert run_to_completion(engine, work) == base
    assert engine.scheduler.num_preemptions > 0
    _accounted(engine)


def test_triton_kernels_verify_like_the_reference(tmp_path):
    """The fast path (fused GDN decode chaining state rows, Triton attention) under the interpreter:
    oracle-drafted greedy output equal to the plain reference run, batches of two and one."""
    path = save_with_mtp(CASES_BY_NAME["next_full_last"], tmp_path)
    ps = [p[:12] for p in prompts()[2:]]
    work = [(ps[0], _greedy(5)), (ps[1], _greedy(11))]  # the second one verifies alone at the end
    base = run_to_completion(build_engine(path, block_size=8, num_kv_blocks=64, max_num_seqs=4), work)
    engine = build_engine(path, block_size=8, num_kv_blocks=64, max_num_seqs=4, speculative=True, num_drafts=2,
                          kernel_backend="triton")
    runner = engine.runner
    runner.proposer = OracleProposer(runner.proposer, oracle_reference(ps, base), VOCAB)
    assert run_to_completion(engine, work) == base
    assert engine.stats()["num_accepted_tokens"] > 0
    _accounted(engine)
