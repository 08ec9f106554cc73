"""The whole engine (scheduler, pools, runner, sampler) on tiny checkpoints, against transformers."""
from __future__ import annotations

import pytest
import torch

from armillary import LLM, SamplingParams
from plugins.qwen_gdn_moe.tests.harness import qwen_registry
from plugins.qwen_gdn_moe.tests.hf_models import CASES, NEW_TOKENS, make_reference
from tests.fixtures.logits_recorder import LogitsRecorder


@pytest.fixture(scope="module", params=CASES, ids=[c.name for c in CASES])
def reference(request, tmp_path_factory):
    return make_reference(request.param, tmp_path_factory.mktemp(request.param.name))


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_generate_one_at_a_time_matches_transformers(reference, async_scheduling):
    llm = LLM(str(reference.model_dir), registry=qwen_registry(), dtype="float32", max_model_len=256,
              async_scheduling=async_scheduling)
    rec = LogitsRecorder(llm.engine.model)
    for prompt, tokens, logits in zip(reference.prompts, reference.tokens, reference.logits):
        rec.rows.clear()
        out = llm.generate({"prompt_token_ids": prompt}, greedy())[0].outputs[0]
        assert out.token_ids == tokens
        assert out.finish_reason == "length"
        ours = torch.stack(rec.rows)
        err = (ours - logits).abs().max() / logits.abs().max()
        assert err < 1e-4, f"relative logits error {err:.2e}"
    assert (llm.engine.num_async_steps > 0) == async_scheduling


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_staggered_chunked_preempted_batch_matches_one_at_a_time(reference, async_scheduling):
    # a 16-token step budget < the longest prompt (100); 20 blocks x 8 = 160 tokens cannot hold all four
    llm = LLM(str(reference.model_dir), registry=qwen_registry(), dtype="float32", max_model_len=256,
              max_num_batched_tokens=16, block_size=8, num_kv_blocks=20, max_num_seqs=4,
              async_scheduling=async_scheduling)
    engine = llm.engine
    done, step = {}, 0
    pending = list(enumerate(reference.prompts))
    while pending or engine.has_unfinished_requests():
        if pending and step % 3 == 0:  # staggered arrival: a new request every third step
            i, prompt = pending.pop(0)
            engine.add_request(f"r{i}", prompt, greedy())
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        step += 1
    assert engine.scheduler.num_preemptions > 0
    assert (engine.num_async_steps > 0) == async_scheduling
    assert [done[f"r{i}"] for i in range(len(reference.prompts))] == reference.tokens
    stats = engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["state_slots_used"] == 0
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
