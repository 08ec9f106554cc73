"""The engine end to end on tiny qwen_gdn_moe checkpoints, with transformers as the oracle."""
from __future__ import annotations

import pytest
import torch

from armillary import LLM, SamplingParams
from tests.fixtures.logits_recorder import LogitsRecorder
from tests.fixtures.tiny_models import hf_greedy, save_tiny_model

F, L = "full_attention", "linear_attention"
PROMPTS = [[3, 17, 42], [5] * 9 + [77, 12, 300, 401, 9, 8, 1], list(range(20, 45)), [99, 100, 101, 102, 103, 104, 7]]
NEW = 32
CASES = {
    "next-full-first": ("qwen3_next", [F, L, L], (4, 2)),
    "next-full-last-mha": ("qwen3_next", [L, L, F], (2, 2)),
    "moe35-cg-several": ("qwen3_5_moe", [L, F, L, F], (4, 1)),
    "moe35-text": ("qwen3_5_moe_text", [F, L, F], (4, 2)),
    "dense35": ("qwen3_5", [L, F, L], (8, 2)),
}


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    kind, layers, heads = CASES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_model(path, kind, layers, heads)
    expected = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    return path, expected


def greedy(max_tokens: int = NEW, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_greedy_tokens_and_logits_match_transformers(checkpoint):
    path, expected = checkpoint
    llm = LLM(str(path), dtype="float32", max_model_len=128)
    rec = LogitsRecorder(llm.engine.model)
    for prompt, (hf_tokens, hf_logits) in zip(PROMPTS, expected):
        rec.rows.clear()
        out = llm.generate({"prompt_token_ids": prompt}, greedy())[0]
        assert out.outputs[0].token_ids == hf_tokens
        assert out.outputs[0].finish_reason == "length"
        ours = torch.stack(rec.rows)
        assert ours.shape == hf_logits.shape
        err = (ours - hf_logits).abs().max() / hf_logits.abs().max()
        assert err < 1e-4, f"relative logits error {err:.2e}"


def test_batched_staggered_chunked_preempted_equals_sequential(checkpoint):
    path, expected = checkpoint
    # chunk 8 < longest prompt (25); 16 blocks x 4 = 64 tokens cannot hold four sequences of ~40-57 tokens
    llm = LLM(str(path), dtype="float32", max_model_len=128, max_num_batched_tokens=8, block_size=4,
              num_kv_blocks=16, max_num_seqs=4)
    engine = llm.engine
    done = {}
    step = 0
    pending = list(enumerate(PROMPTS))
    while pending or engine.has_unfinished_requests():
        if pending and step % 3 == 0:  # staggered arrival: one new request every third step
            i, prompt = pending.pop(0)
            engine.add_request(f"r{i}", prompt, greedy())
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        step += 1
    assert engine.scheduler.num_preemptions > 0
    for i, (hf_tokens, _) in enumerate(expected):
        assert done[f"r{i}"] == hf_tokens, f"request {i}"
    stats = engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["state_slots_used"] == 0
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
