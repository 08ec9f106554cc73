"""GLM-4.7-Flash's MTP layer through core's speculative runner, and prefix caching on its latent
cache: greedy output with speculation on (K = 1, 2; the MTP head's drafts and oracle drafts that
are partly right) equals it off; a prefix-cache hit equals a miss, with and without speculation."""
from __future__ import annotations

import pytest

from armillary.sampling_params import SamplingParams
from plugins.glm_flash.tests.harness import build_engine
from plugins.glm_flash.tests.hf_models import VOCAB, prompts
from plugins.glm_flash.tests.test_mtp import mtp_checkpoint  # noqa: F401  (the fixture)
from tests.fixtures.engine_runs import run_to_completion
from tests.fixtures.oracle_drafts import OracleProposer, oracle_reference


def _work(n: int = 20):
    return [(p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)) for p in prompts()]


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("oracle", [False, True], ids=["mtp", "oracle"])
def test_mtp_speculation_equals_no_speculation(mtp_checkpoint, k, oracle):  # noqa: F811
    directory = mtp_checkpoint[0]
    work = _work()
    base = run_to_completion(build_engine(directory, block_size=8, num_kv_blocks=128, max_num_seqs=8), work)
    engine = build_engine(directory, block_size=8, num_kv_blocks=128, max_num_seqs=8, speculative=True, num_drafts=k)
    if oracle:
        engine.runner.proposer = OracleProposer(engine.runner.proposer, oracle_reference(prompts(), base), VOCAB)
    assert run_to_completion(engine, work) == base
    stats = engine.stats()
    assert stats["num_verify_steps"] > 0
    if oracle:
        assert stats["num_accepted_tokens"] > 0
    engine.cache.check_accounting([])


@pytest.mark.parametrize("speculative", [False, True])
def test_prefix_cache_hit_equals_miss(mtp_checkpoint, speculative):  # noqa: F811
    directory = mtp_checkpoint[0]
    kw = dict(speculative=True, num_drafts=2) if speculative else {}
    prompt = prompts()[-1]
    first = [(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))]
    miss = build_engine(directory, block_size=8, num_kv_blocks=128, max_num_seqs=4, **kw)
    turn1 = run_to_completion(miss, first)[0]
    follow = prompt + turn1 + [5, 6, 7]  # the next turn extends prompt and answer
    cold = run_to_completion(build_engine(directory, block_size=8, num_kv_blocks=128, max_num_seqs=4, **kw),
                [(follow, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))])
    cached = build_engine(directory, block_size=8, num_kv_blocks=128, max_num_seqs=4, enable_prefix_caching=True, **kw)
    assert run_to_completion(cached, first)[0] == turn1
    hit = run_to_completion(cached, [(follow, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))])
    assert hit == cold
    assert cached.stats()["prefix_cache_hit_tokens"] > 0
    cached.cache.check_accounting([])
