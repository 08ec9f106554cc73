"""Prefix caching on a hybrid model (tiny Qwen3-Next: GDN + full attention): a hit needs the KV
blocks and a recurrent-state snapshot at exactly the hit position. Greedy output with hits equals
the output without prefix caching: a hit at a checkpoint (block-aligned snapshot), a second
conversation turn (a mid-block hit from the end-of-sequence snapshot and a copied tail block),
8 concurrent requests, forced preemption, n > 1, async scheduling and an evicted snapshot;
blocks, slots and snapshot rows are accounted for after every run."""
from __future__ import annotations

import pytest
import torch

from armillary import LLM, SamplingParams
from plugins.qwen_gdn_moe.tests.harness import qwen_registry
from plugins.qwen_gdn_moe.tests.hf_models import CASES_BY_NAME, VOCAB, build_hf_model

BS = 8
INTERVAL = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("prefix_qwen")
    build_hf_model(CASES_BY_NAME["next_full_last"]).save_pretrained(directory)
    return directory


def make_llm(model_dir, prefix: bool, **kw) -> LLM:
    args = dict(dtype="float32", device="cpu", max_model_len=256, block_size=BS, max_num_seqs=8,
                max_num_batched_tokens=64, num_kv_blocks=96, enable_prefix_caching=prefix,
                state_checkpoint_interval=INTERVAL, num_state_snapshots=24 if prefix else 0)
    return LLM(str(model_dir), registry=qwen_registry(), **{**args, **kw})


@pytest.fixture(scope="module")
def reference(model_dir) -> LLM:
    return make_llm(model_dir, prefix=False)


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def generate(llm: LLM, prompts: list[list[int]], params=GREEDY) -> tuple[list[list[int]], list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    llm.engine.cache.check_accounting(list(llm.engine.scheduler.running))
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


def test_hit_at_a_checkpoint_and_a_second_turn_equal_a_miss(model_dir, reference):
    llm = make_llm(model_dir, prefix=True)
    shared = tokens(1, 35)
    generate(llm, [shared + tokens(2, 9)])
    other = shared + tokens(3, 7)
    got, (cached,) = generate(llm, [other])
    assert cached == 32  # the deepest checkpoint inside the shared 35 tokens (every 16)
    want, _ = generate(reference, [other])
    assert got == want

    (answer,), _ = generate(llm, [shared], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    turn = shared + answer + tokens(4, 10)
    got, (cached,) = generate(llm, [turn])
    assert cached == len(shared) + len(answer) - 1 and cached % BS  # the first turn's end, mid-block
    want, _ = generate(reference, [turn])
    assert got == want
    st = llm.engine.stats()
    assert st["kv_blocks_used"] == 0 and st["state_slots_used"] == 0 and st["state_snapshots_cached"] > 0


def test_8_concurrent_requests_on_a_shared_prefix(model_dir, reference):
    llm = make_llm(model_dir, prefix=True)
    shared = tokens(5, 40)
    generate(llm, [shared + tokens(6, 3)])
    prompts = [shared + tokens(10 + i, 2 + i) for i in range(8)]
    got, cached = generate(llm, prompts)
    assert cached == [32] * 8
    want, _ = generate(reference, prompts)
    assert got == want


def test_forced_preemption_resumes_from_its_own_end_snapshot(model_dir, reference):
    llm = make_llm(model_dir, prefix=True, num_kv_blocks=12)
    shared = tokens(7, 19)
    prompts = [shared + tokens(20 + i, 3) for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    got, _ = generate(llm, prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.stats()["prefix_cache_hit_tokens"] > 0
    want, _ = generate(reference, prompts, params)
    assert got == want


def test_n_samples_resume_from_the_prompt_checkpoint(model_dir, reference):
    llm = make_llm(model_dir, prefix=True)
    prompt = tokens(8, 21)
    params = SamplingParams(temperature=0.0, max_tokens=5, n=3, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": prompt}], params)
    llm.engine.cache.check_accounting()
    want = reference.generate([{"prompt_token_ids": prompt}], params)
    assert [c.token_ids for c in outs[0].outputs] == [c.token_ids for c in want[0].outputs]
    assert llm.engine.stats()["prefix_cache_hit_tokens"] == 2 * 16  # the prompt's last full block


def test_async_scheduling_second_turn(model_dir, reference):
    llm = make_llm(model_dir, prefix=True, async_scheduling=True)
    first = tokens(9, 27)
    (free_run,), _ = generate(reference, [first])
    i = next(i for i in range(1, 5) if free_run[i] not in free_run[:i])
    stop = SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[free_run[i]])
    (answer,), _ = generate(llm, [first], stop)
    assert llm.engine.num_async_steps > 0 and answer == free_run[:i + 1]
    turn = first + answer + tokens(10, 5)
    got, (cached,) = generate(llm, [turn])
    assert cached == len(first) + len(answer)  # the decode in flight at the end computed the stop token
    want, _ = generate(reference, [turn])
    assert got == want


def test_an_evicted_snapshot_is_no_longer_a_hit(model_dir, reference):
    llm = make_llm(model_dir, prefix=True, num_state_snapshots=2)
    first = tokens(11, 20)
    generate(llm, [first])  # rows: the checkpoint at 16 and the end at 25
    generate(llm, [tokens(12, 20)])  # evicts both
    again = first + tokens(13, 4)
    got, (cached,) = generate(llm, [again])
    assert cached == 0 and llm.engine.cache.pool.num_evictions == 0  # blocks cached, no state: a miss
    want, _ = generate(reference, [again])
    assert got == want


@pytest.mark.parametrize("num_kv_blocks", [96, 14], ids=["roomy", "preempting"])
def test_with_mtp_speculation_8_requests_equal_neither(tmp_path, num_kv_blocks):
    """Both at once: drafts are verified (and rolled back) while prefixes hit; the output equals the
    plain engine's (no speculation, no prefix caching)."""
    from plugins.qwen_gdn_moe.tests.mtp_checkpoint import save_with_mtp

    directory = save_with_mtp(CASES_BY_NAME["next_full_last"], tmp_path / "mtp")
    shared = tokens(14, 22)
    prompts = [shared + tokens(30 + i, 2 + i % 3) for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain = make_llm(directory, prefix=False)
    want, _ = generate(plain, [shared + tokens(15, 4)] + prompts, params)
    both = make_llm(directory, prefix=True, speculative=True, num_drafts=2, num_kv_blocks=num_kv_blocks)
    got, cached = generate(both, [shared + tokens(15, 4)], params)  # caches the shared prefix
    more, cached = generate(both, prompts, params)
    assert got + more == want
    st = both.engine.stats()
    assert st["num_verify_steps"] > 0 and st["prefix_cache_hit_tokens"] > 0
    if num_kv_blocks == 14:
        assert both.engine.scheduler.num_preemptions > 0
