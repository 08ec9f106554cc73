"""Nemotron-H MTP speculative decoding through core's runner (tiny Mamba-2 + attention + MoE models with
an MTP head): greedy output with speculation on (K = 1, 2, 3) equals it off, batched, through the
checkpoint's own MTP head and through an oracle drafter whose drafts are partly right
(``tests/fixtures/oracle_drafts.py``), so every accepted length 0..K occurs and the Mamba states kept
per verified position are committed after each; concurrent requests under forced preemption; a
prefix-cache hit (a state checkpoint and a second turn) with speculation on; every block, slot,
snapshot and state row accounted for afterwards."""
from __future__ import annotations

import pytest
import torch

from armillary.sampling_params import SamplingParams
from armillary.testing import cpu_engine
from plugins.nemotron.tests.hf_models import VOCAB, nemotron_registry, prompts
from plugins.nemotron.tests.mtp_checkpoint import save_with_mtp
from tests.fixtures.engine_runs import run_to_completion
from tests.fixtures.oracle_drafts import use_oracle_drafts

NEW = 24
# (main case, MTP sublayers): Nemotron-3 Super's attention + MoE, and MoE first with a dense relu² MLP last
CHECKPOINTS = [("ME*ME_groups2_chunk8", "*E"), ("M*-EM_groups4_router_groups", "E*-")]


@pytest.fixture(scope="module", params=CHECKPOINTS, ids=[f"{c}+mtp{p}" for c, p in CHECKPOINTS])
def mtp_dir(request, tmp_path_factory):
    case, pattern = request.param
    return save_with_mtp(case, pattern, tmp_path_factory.mktemp("nemotron_spec")).model_dir


def _engine(model_dir, **kw):
    args = dict(block_size=8, num_kv_blocks=128, max_num_seqs=8, max_model_len=256)
    return cpu_engine(model_dir, nemotron_registry(), **{**args, **kw})


def _greedy(n: int = NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _accounted(engine) -> None:
    engine.cache.check_accounting([])  # every block, slot and state row in exactly one place
    stats = engine.cache.stats()
    assert stats["kv_blocks_used"] == 0 and stats["state_slots_used"] == 0, stats
    assert stats["kv_blocks_free"] + stats["kv_blocks_cached"] == stats["kv_blocks_total"], stats
    assert stats["state_snapshots_used"] == stats["state_snapshots_cached"], stats  # only the prefix cache holds any
    assert not engine.scheduler.running and not engine.scheduler.waiting


def _with_oracle(engine, ps: list[list[int]], base: list[list[int]]) -> list[int]:
    """Oracle drafts on ``engine``; returns the list the accepted length of every verified chunk goes to."""
    return use_oracle_drafts(engine, ps, base, VOCAB)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_mtp_greedy_equals_no_speculation(mtp_dir, k):
    work = [(p, _greedy()) for p in prompts()]
    base = run_to_completion(_engine(mtp_dir), work)
    engine = _engine(mtp_dir, speculative=True, num_drafts=k)
    assert run_to_completion(engine, work) == base
    stats = engine.stats()
    assert stats["num_verify_steps"] > 0 and stats["num_draft_tokens"] > 0
    _accounted(engine)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_oracle_drafts_accept_every_length_and_equal_no_speculation(mtp_dir, k):
    ps = prompts()
    work = [(p, _greedy()) for p in ps]
    base = run_to_completion(_engine(mtp_dir), work)
    engine = _engine(mtp_dir, speculative=True, num_drafts=k)
    lengths = _with_oracle(engine, ps, base)
    assert run_to_completion(engine, work) == base
    assert set(lengths) == set(range(k + 1)), lengths  # every accepted length happened
    assert engine.stats()["spec_tokens_per_step"] > 1.0
    _accounted(engine)


def test_concurrent_requests_with_forced_preemption(mtp_dir):
    gen = torch.Generator().manual_seed(5)
    ps = [torch.randint(1, VOCAB, (int(n),), generator=gen).tolist() for n in torch.randint(3, 40, (8,), generator=gen)]
    work = [(p, _greedy(20)) for p in ps]
    base = run_to_completion(_engine(mtp_dir), work)
    engine = _engine(mtp_dir, num_kv_blocks=24, speculative=True, num_drafts=2)
    _with_oracle(engine, ps, base)
    assert run_to_completion(engine, work) == base
    assert engine.scheduler.num_preemptions > 0
    assert engine.stats()["num_accepted_tokens"] > 0
    _accounted(engine)


def test_prefix_cache_hits_with_speculation_equal_misses(mtp_dir):
    """A hit at a state checkpoint (every 16 tokens) and at a second turn's end-of-sequence snapshot."""
    gen = torch.Generator().manual_seed(9)
    shared = torch.randint(1, VOCAB, (35,), generator=gen).tolist()
    first = shared + torch.randint(1, VOCAB, (9,), generator=gen).tolist()
    other = shared + torch.randint(1, VOCAB, (7,), generator=gen).tolist()
    plain = _engine(mtp_dir)
    turn1 = run_to_completion(plain, [(first, _greedy(12))])[0]
    follow = first + turn1 + [5, 6, 7]  # the next turn extends the first prompt and its answer
    want = run_to_completion(plain, [(other, _greedy(12)), (follow, _greedy(12))])
    ps = [first, other, follow]
    cached = _engine(mtp_dir, speculative=True, num_drafts=2, enable_prefix_caching=True,
                     state_checkpoint_interval=16, num_state_snapshots=24)
    _with_oracle(cached, ps, [turn1, *want])
    assert run_to_completion(cached, [(first, _greedy(12))]) == [turn1]
    hits = cached.stats()["prefix_cache_hit_tokens"]
    assert run_to_completion(cached, [(other, _greedy(12))]) == want[:1]
    assert cached.stats()["prefix_cache_hit_tokens"] - hits == 32  # the deepest checkpoint inside the shared 35
    hits = cached.stats()["prefix_cache_hit_tokens"]
    assert run_to_completion(cached, [(follow, _greedy(12))]) == want[1:]
    assert cached.stats()["prefix_cache_hit_tokens"] - hits >= len(first)  # the first turn's end snapshot
    assert cached.stats()["num_accepted_tokens"] > 0
    _accounted(cached)
    assert cached.cache.stats()["state_snapshots_cached"] > 0


def test_triton_kernels_verify_like_the_reference(tmp_path):
    """The fast path (the fused Mamba decode kernel chained over state rows, Triton attention and MoE) under
    the interpreter: oracle-drafted greedy output equal to the plain reference run, two prompts then one."""
    path = save_with_mtp(*CHECKPOINTS[0], tmp_path).model_dir
    ps = [p[:12] for p in prompts()[1:3]]
    work = [(ps[0], _greedy(5)), (ps[1], _greedy(9))]  # the second one verifies alone at the end
    base = run_to_completion(_engine(path, num_kv_blocks=64, max_num_seqs=4), work)
    engine = _engine(path, num_kv_blocks=64, max_num_seqs=4, speculative=True, num_drafts=2, kernel_backend="triton")
    _with_oracle(engine, ps, base)
    assert run_to_completion(engine, work) == base
    assert engine.stats()["num_accepted_tokens"] > 0
    _accounted(engine)
