"""Prefix caching through the engine on a tiny random Llama (pure attention): greedy output with
cache hits equals the output without prefix caching, for a second conversation turn (a hit that
ends mid-block, through the copied tail block), a shared prefix, 8 concurrent requests, forced
preemption, n > 1 and async scheduling; every block is accounted for after each run."""
from __future__ import annotations

import pytest
import torch

import armillary_llama.hooks as llama_hooks
from armillary import LLM, SamplingParams
from armillary.registry import PluginRegistry

BS = 8
VOCAB = 160
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.08)
    model = LlamaForCausalLM(config).eval()
    directory = tmp_path_factory.mktemp("prefix_llama")
    model.save_pretrained(directory)
    return directory


def make_llm(model_dir, prefix: bool, **kw) -> LLM:
    registry = PluginRegistry()
    registry.register(llama_hooks, "llama", distribution="armillary-llama")
    args = dict(dtype="float32", device="cpu", max_model_len=256, block_size=BS, max_num_seqs=8,
                max_num_batched_tokens=64, num_kv_blocks=96, enable_prefix_caching=prefix)
    return LLM(str(model_dir), registry=registry, **{**args, **kw})


@pytest.fixture(scope="module")
def reference(model_dir) -> LLM:
    return make_llm(model_dir, prefix=False)


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def generate(llm: LLM, prompts: list[list[int]], params=GREEDY) -> tuple[list[list[int]], list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    llm.engine.cache.check_accounting(list(llm.engine.scheduler.running))
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


def test_second_turn_hits_mid_block_and_equals_a_miss(model_dir, reference):
    llm = make_llm(model_dir, prefix=True)
    first = tokens(1, 37)
    (answer,), (cached,) = generate(llm, [first])
    assert cached == 0
    second = first + answer + tokens(2, 11)
    got, (cached,) = generate(llm, [second])
    # the first turn computed 37 + 7 positions (its last token was sampled, not computed): a hit
    # of 5 full blocks and a partial tail of 4 positions, copied before the second turn writes on
    assert cached == 44 and cached % BS
    want, _ = generate(reference, [second])
    assert got == want
    again, (cached,) = generate(llm, [second])  # the whole prompt but its last token
    assert again == want and cached == len(second) - 1
    st = llm.engine.stats()
    assert st["kv_blocks_used"] == 0 and st["kv_blocks_cached"] > 0
    assert st["prefix_cache_hit_rate"] == pytest.approx((44 + len(second) - 1) / (37 + 2 * len(second)))


def test_shared_prefix_with_8_concurrent_requests(model_dir, reference):
    llm = make_llm(model_dir, prefix=True)
    prefix = tokens(3, 29)
    generate(llm, [prefix + tokens(4, 5)])
    prompts = [prefix + tokens(10 + i, 3 + i) for i in range(8)]
    got, cached = generate(llm, prompts)
    assert cached == [24] * 8  # 3 full blocks of the shared 29 tokens
    want, _ = generate(reference, prompts)
    assert got == want


def test_forced_preemption_rehits_and_equals_a_miss(model_dir, reference):
    llm = make_llm(model_dir, prefix=True, num_kv_blocks=14)
    prefix = tokens(5, 21)
    prompts = [prefix + tokens(20 + i, 4) for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    got, _ = generate(llm, prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.stats()["prefix_cache_hit_tokens"] > 0
    want, _ = generate(reference, prompts, params)
    assert got == want


def test_n_samples_share_the_prompt(model_dir, reference):
    llm = make_llm(model_dir, prefix=True)
    prompt = tokens(6, 26)
    params = SamplingParams(temperature=0.0, max_tokens=6, n=3, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": prompt}], params)
    llm.engine.cache.check_accounting()
    want = reference.generate([{"prompt_token_ids": prompt}], params)
    assert [c.token_ids for c in outs[0].outputs] == [c.token_ids for c in want[0].outputs]
    assert llm.engine.stats()["prefix_cache_hit_tokens"] == 2 * 24  # the siblings resumed after 3 blocks


def test_async_scheduling_caches_the_in_flight_last_position(model_dir, reference):
    llm = make_llm(model_dir, prefix=True, async_scheduling=True)
    first = tokens(7, 30)
    (free_run,), _ = generate(reference, [first])
    i = next(i for i in range(1, 7) if free_run[i] not in free_run[:i])
    stop = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[free_run[i]])
    (answer,), _ = generate(llm, [first], stop)  # ends on a stop token, the next decode already launched
    assert llm.engine.num_async_steps > 0 and answer == free_run[:i + 1]
    second = first + answer + tokens(8, 6)
    got, (cached,) = generate(llm, [second])
    # the step in flight when the first turn ended computed its stop token's position too
    assert cached == len(first) + len(answer)
    want, _ = generate(reference, [second])
    assert got == want


def test_eviction_under_memory_pressure_keeps_output_exact(model_dir, reference):
    llm = make_llm(model_dir, prefix=True, num_kv_blocks=12)
    prompts = [tokens(40 + i, 33) for i in range(4)]
    for p in prompts:  # each fills most of the pool: the older prefixes are evicted
        generate(llm, [p])
    assert llm.engine.cache.pool.num_evictions > 0
    got, cached = generate(llm, [prompts[0], prompts[-1]])
    assert cached[1] > 0
    want, _ = generate(reference, [prompts[0], prompts[-1]])
    assert got == want
