"""The armillary glm4_moe_lite model, loaded from transformers-saved checkpoints, against transformers itself:
logits at every step, greedy continuations, batched / chunked / mixed steps, decode steps without host
lists (as a CUDA graph stages them), both expert layouts, the cache layout."""
from __future__ import annotations

import pytest
import torch

from armillary.cache_spec import LatentAttention
from armillary.testing import (
    assert_batched_greedy,
    assert_logits_close as _assert_close,
    assert_stepwise_greedy,
    lazy_references,
    read_checkpoint,
    swap_expert_layout,
    write_checkpoint,
)
from armillary_glm_flash.model import Glm4MoeLiteForCausalLM
from plugins.glm_flash.tests.harness import Harness
from plugins.glm_flash.tests.hf_models import CASES, GROUPED, NEW_TOKENS, Case, make_reference


def ids(cases: list[Case]) -> list[str]:
    return [c.name for c in cases]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return lazy_references(make_reference, tmp_path_factory)


def assert_logits_close(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    _assert_close(got, ref, what, tol=2e-5)


@pytest.mark.parametrize("case", [*CASES, GROUPED], ids=ids([*CASES, GROUPED]))
def test_greedy_decode_matches_generate(case, references):
    """Each prompt alone: prompt logits, every decode step's logits (steps staged as a CUDA graph stages
    them: no host lists) and all 32 greedy tokens."""
    ref = references(case)
    assert_stepwise_greedy(Harness(ref.model_dir), ref, NEW_TOKENS, assert_logits_close, decode_only=True)


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_batched_prefill_then_batched_decode(case, references):
    ref = references(case)
    assert_batched_greedy(Harness(ref.model_dir), ref, NEW_TOKENS, assert_logits_close, decode_only=True)


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_chunked_prefill_mixed_with_decodes(case, references):
    """A 100-token prompt in three chunks: 37 tokens, 5 (short: absorbed over the cached latents) beside a
    fresh prompt, then the rest (long: decompressed from the cache) beside a decode; then mixed steps of
    decodes and a one-token prompt; fed transformers' tokens."""
    ref = references(case)
    harness = Harness(ref.model_dir, block_size=4)
    long_, short, single = 3, 1, 0
    long_prompt = ref.prompts[long_]
    harness.step([(long_, long_prompt[:37])])
    harness.step([(long_, long_prompt[37:42]), (short, ref.prompts[short])])
    logits = harness.step([(long_, long_prompt[42:]), (short, ref.tokens[short][:1])])
    assert_logits_close(logits[0], ref.logits[long_][0], "long prompt after its third chunk")
    assert_logits_close(logits[1], ref.logits[short][1], "short prompt's first decode beside it")
    logits = harness.step([(long_, ref.tokens[long_][:1]), (single, ref.prompts[single]),
                           (short, ref.tokens[short][1:3])])
    assert_logits_close(logits[0], ref.logits[long_][1], "long decode step 1")
    assert_logits_close(logits[1], ref.logits[single][0], "one-token prompt prefilled among decodes")
    assert_logits_close(logits[2], ref.logits[short][3], "two-token chunk after context (verify-shaped)")
    fed = {long_: 1, short: 3, single: 0}
    for _ in range(4):
        order = (long_, short, single)
        logits = harness.step([(s, ref.tokens[s][fed[s]:fed[s] + 1]) for s in order])
        for row, s in enumerate(order):
            fed[s] += 1
            assert_logits_close(logits[row], ref.logits[s][fed[s]], f"prompt {s} decode {fed[s]}")


def test_uniform_steps_without_host_lists(references):
    """Three new tokens per sequence after cached context, without host lists (a speculative verify as a CUDA
    graph would stage it): every row's logits equal transformers'."""
    ref = references(CASES[0])
    harness = Harness(ref.model_dir)
    harness.step([(1, ref.prompts[1]), (3, ref.prompts[3])])
    logits = harness.step([(1, ref.tokens[1][:3]), (3, ref.tokens[3][:3])], no_host_lists=True, all_rows=True)
    for row, (seq, k) in enumerate((s, k) for s in (1, 3) for k in range(3)):
        assert_logits_close(logits[row], ref.logits[seq][k + 1], f"prompt {seq} verify row {k}")


def test_stacked_expert_layout_loads_identically(references, tmp_path):
    ref = references(CASES[0])
    stacked = swap_expert_layout(read_checkpoint(ref.model_dir))  # transformers saves per-expert names
    assert any(k.endswith("experts.gate_up_proj") for k in stacked)
    write_checkpoint(tmp_path, stacked, source=ref.model_dir)
    a, b = Harness(ref.model_dir), Harness(tmp_path)
    for (na, pa), (nb, pb) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert na == nb and torch.equal(pa, pb), na
    assert torch.equal(a.step([(0, ref.prompts[2])]), b.step([(0, ref.prompts[2])]))


def test_cache_layout_is_one_latent_per_token(references):
    ref = references(CASES[0])
    harness = Harness(ref.model_dir)
    cfg = harness.model.config
    layout = Glm4MoeLiteForCausalLM.cache_layout(harness.engine.hf_config)
    assert layout == [LatentAttention(40, 12)] * cfg.num_hidden_layers
    assert layout[0].bytes_per_token(torch.bfloat16) == (40 + 12) * 2
    assert Glm4MoeLiteForCausalLM.draft_cache_layout(harness.engine.hf_config) == []
    caches = harness.engine.runner.caches
    assert all(c.kv.shape[1:] == (8, 52) for c in caches)
