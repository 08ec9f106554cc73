"""The whole engine (scheduler, latent cache group, runner, sampler) on tiny glm4_moe_lite checkpoints, against
transformers: one request at a time, and a staggered batch under a small step budget (chunked prefills mixed
with decodes) and a small pool (preemption by recompute)."""
from __future__ import annotations

import pytest
import torch

from armillary import LLM, SamplingParams
from plugins.glm_flash.tests.harness import glm_registry
from plugins.glm_flash.tests.hf_models import CASES, NEW_TOKENS, make_reference
from tests.fixtures.logits_recorder import LogitsRecorder


@pytest.fixture(scope="module", params=CASES, ids=[c.name for c in CASES])
def reference(request, tmp_path_factory):
    return make_reference(request.param, tmp_path_factory.mktemp(request.param.name))


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def test_generate_one_at_a_time_matches_transformers(reference):
    llm = LLM(str(reference.model_dir), registry=glm_registry(), dtype="float32", max_model_len=256)
    rec = LogitsRecorder(llm.engine.model)
    for prompt, tokens, logits in zip(reference.prompts, reference.tokens, reference.logits):
        rec.rows.clear()
        out = llm.generate({"prompt_token_ids": prompt}, greedy())[0].outputs[0]
        assert out.token_ids == tokens
        ours = torch.stack(rec.rows)
        err = (ours - logits).abs().max() / logits.abs().max()
        assert err < 2e-5, f"relative logits error {err:.2e}"


def test_staggered_chunked_preempted_batch_matches_transformers(reference):
    # a 16-token step budget < the longest prompt (100); 20 blocks x 8 = 160 tokens cannot hold all four
    llm = LLM(str(reference.model_dir), registry=glm_registry(), dtype="float32", max_model_len=256,
              max_num_batched_tokens=16, block_size=8, num_kv_blocks=20, max_num_seqs=4)
    engine = llm.engine
    done, step = {}, 0
    pending = list(enumerate(reference.prompts))
    while pending or engine.has_unfinished_requests():
        if pending and step % 3 == 0:  # a new request every third step
            i, prompt = pending.pop(0)
            engine.add_request(f"r{i}", prompt, greedy())
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        step += 1
    assert engine.scheduler.num_preemptions > 0
    assert [done[f"r{i}"] for i in range(len(reference.prompts))] == reference.tokens
    stats = engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0
