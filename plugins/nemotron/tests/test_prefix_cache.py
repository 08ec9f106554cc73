"""Prefix caching on Nemotron-H (Mamba-2 + attention): a hit resumes from the KV blocks and a Mamba
conv + SSM state snapshot, through core's cache groups with no model-side case; greedy output with
a hit equals a miss (and transformers), at a block-aligned checkpoint and at a second turn's
mid-block end-of-sequence snapshot, one at a time and batched under preemption."""
from __future__ import annotations

import pytest
import torch

from armillary import LLM, SamplingParams
from plugins.nemotron.tests.hf_models import CASES_BY_NAME, VOCAB, build_hf_model, nemotron_registry

BS = 8
INTERVAL = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("prefix_nemotron")
    build_hf_model(CASES_BY_NAME["ME*ME_groups2_chunk8"]).save_pretrained(directory)
    return directory


def make_llm(model_dir, prefix: bool, **kw) -> LLM:
    args = dict(dtype="float32", device="cpu", max_model_len=256, block_size=BS, max_num_seqs=8,
                max_num_batched_tokens=64, num_kv_blocks=96, enable_prefix_caching=prefix,
                state_checkpoint_interval=INTERVAL, num_state_snapshots=24 if prefix else 0)
    return LLM(str(model_dir), registry=nemotron_registry(), **{**args, **kw})


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def generate(llm: LLM, prompts: list[list[int]], params=GREEDY) -> tuple[list[list[int]], list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


@torch.no_grad()
def hf_greedy(model_dir, prompt: list[int], new: int) -> list[int]:
    hf = build_hf_model(CASES_BY_NAME["ME*ME_groups2_chunk8"])
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                      do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_hit_at_a_checkpoint_and_a_second_turn_equal_a_miss(model_dir):
    llm, reference = make_llm(model_dir, prefix=True), make_llm(model_dir, prefix=False)
    shared = tokens(1, 35)
    generate(llm, [shared + tokens(2, 9)])
    other = shared + tokens(3, 7)
    got, (cached,) = generate(llm, [other])
    assert cached == 32  # the deepest state checkpoint inside the shared 35 tokens (every 16)
    want, (ref_cached,) = generate(reference, [other])
    assert ref_cached == 0 and got == want == [hf_greedy(model_dir, other, 6)]

    (answer,), _ = generate(llm, [shared], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    turn = shared + answer + tokens(4, 10)
    got, (cached,) = generate(llm, [turn])
    assert cached == len(shared) + len(answer) - 1 and cached % BS  # the first turn's end, mid-block
    want, _ = generate(reference, [turn])
    assert got == want
    st = llm.engine.stats()
    assert st["kv_blocks_used"] == 0 and st["state_slots_used"] == 0 and st["state_snapshots_cached"] > 0


def test_batched_hits_under_preemption_equal_misses(model_dir):
    # 10 blocks of 8: one 61-token sequence fits, four sharing a 40-token prefix do not
    llm = make_llm(model_dir, prefix=True, num_kv_blocks=10, max_num_batched_tokens=24)
    reference = make_llm(model_dir, prefix=False)
    longer = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    shared = tokens(5, 40)
    generate(llm, [shared + tokens(6, 3)])
    prompts = [shared + tokens(10 + i, 2 + i) for i in range(4)]
    got, cached = generate(llm, prompts, longer)
    assert max(cached) == 32
    want, _ = generate(reference, prompts, longer)
    assert got == want
    assert llm.engine.scheduler.num_preemptions > 0
