"""Gemma 3 / Gemma 4 through armillary's offline API against transformers on tiny random checkpoints:
greedy tokens and log-probabilities for 32 steps (batched, whole and chunked prefills), raw logits
to float32 tolerance, the window really applied, and the cache layout each config gives."""
from __future__ import annotations

import pytest
import torch

from armillary import LLM, SamplingParams
from armillary.cache_spec import FullAttention, SlidingWindow
from armillary.hf_config import HFConfig
from armillary.memory.planner import group_layers
from armillary.testing import LogitsRecorder
from armillary_gemma.model import Gemma4ForCausalLM
from plugins.gemma.tests.gemma_hf import BLOCK, CONFIGS, WINDOW, assert_greedy_matches, hf_greedy, prompts

NEW = 32


def _llm(directory, registry, budget: int = 2048, **kw) -> LLM:
    return LLM(model=str(directory), registry=registry, dtype="float32", block_size=BLOCK, max_num_seqs=4,
               max_num_batched_tokens=budget, max_model_len=128, cpu_kv_cache_space_gb=0.05, **kw)


# 2048: each prompt in one windowed prefill; 16: chunks after cached context, mixed with decodes
@pytest.mark.parametrize("budget", [2048, 16])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_and_logprobs_match_transformers(name, budget, tiny_gemma, gemma_registry):
    directory, hf_model = tiny_gemma(name)
    llm = _llm(directory, gemma_registry, budget)
    assert llm.engine.arch.name == name[:6]
    assert_greedy_matches(llm, hf_model, prompts(), new_tokens=NEW, atol=1e-4)


@pytest.mark.parametrize("name", ["gemma3", "gemma4_dense", "gemma4_moe"])
def test_logits_match_to_float32_tolerance(name, tiny_gemma, gemma_registry):
    """Every logits row the engine computes (prefill's last, then each decode) against transformers'."""
    directory, hf_model = tiny_gemma(name)
    llm = _llm(directory, gemma_registry)
    rec = LogitsRecorder(llm.engine.model)
    prompt = prompts()[0]
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    ref = hf_greedy(hf_model, prompt, 8)
    assert len(rec.rows) == 8
    for got, want in zip(rec.rows, ref.logits):
        torch.testing.assert_close(got, want[0].float(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["gemma3", "gemma4_dense"])
def test_window_changes_the_output(name, tiny_gemma, gemma_registry):
    """The same weights with the window widened past the prompt give other tokens: the window is applied."""
    directory, hf_model = tiny_gemma(name)
    prompt = prompts()[0]
    ours = _llm(directory, gemma_registry).generate(
        [{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
    hf_model.config.sliding_window = 10_000
    full = hf_greedy(hf_model, prompt, NEW).sequences[0, len(prompt):].tolist()
    assert ours[0].outputs[0].token_ids != full


def test_gemma4_cache_layout_shares_kv_and_packs_pages_by_bytes():
    dense = Gemma4ForCausalLM.cache_layout(HFConfig(CONFIGS["gemma4_dense"]))
    sw, glob = SlidingWindow(2, 16, window=WINDOW), FullAttention(1, 32)
    # layers 5-7 share KV (num_kv_shared_layers 3): with layer 2 (global) and 4 (sliding)
    assert dense == [sw, sw, glob, sw, sw, None, None, None]
    groups, _ = group_layers(dense, torch.float32)  # same bytes per token, another shape: one layer per position
    assert sorted((g.layers, g.per_position) for g in groups) == [((0,), 1), ((1,), 1), ((2,), 1), ((3,), 1),
                                                                  ((4,), 1)]
    moe = Gemma4ForCausalLM.cache_layout(HFConfig(CONFIGS["gemma4_moe"]))
    assert moe[2] == FullAttention(2, 32) and moe[0] == sw  # no k_eq_v: globals keep num_key_value_heads
    groups, _ = group_layers(moe, torch.float32)  # a global page is two sliding pages: two sliding layers each
    assert sorted((g.layers, g.per_position) for g in groups) == [((0, 1, 3, 4), 2), ((2, 5), 1)]


def _as_multimodal(directory, prefix: str, architecture: str, model_type: str) -> None:
    """Rewrite a saved ``*ForCausalLM`` checkpoint as its ``*ForConditionalGeneration`` layout: the text model
    under ``prefix``, the config nested as ``text_config``, and a vision tower beside it."""
    import json

    from safetensors.torch import load_file, save_file

    (shard,) = directory.glob("*.safetensors")
    tensors = {prefix + name[len("model."):] if name.startswith("model.") else name: t
               for name, t in load_file(shard).items()}
    tensors["model.vision_tower.vision_model.embeddings.patch_embedding.weight"] = torch.zeros(4, 3, 2, 2)
    tensors["model.multi_modal_projector.mm_input_projection_weight"] = torch.zeros(4, 64)
    save_file(tensors, shard, metadata={"format": "pt"})
    text = json.loads((directory / "config.json").read_text())
    config = {"architectures": [architecture], "model_type": model_type, "text_config": text}
    (directory / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("name,prefix,architecture,model_type", [
    ("gemma3", "model.language_model.", "Gemma3ForConditionalGeneration", "gemma3"),
    ("gemma3", "language_model.model.", "Gemma3ForConditionalGeneration", "gemma3"),  # the 2025 releases
    ("gemma4_dense", "model.language_model.", "Gemma4ForConditionalGeneration", "gemma4"),
])
def test_multimodal_checkpoints_serve_their_text_model(name, prefix, architecture, model_type, tiny_gemma,
                                                       gemma_registry, caplog):
    import logging

    directory, hf_model = tiny_gemma(name)
    _as_multimodal(directory, prefix, architecture, model_type)
    with caplog.at_level(logging.INFO, logger="armillary_gemma"):
        llm = _llm(directory, gemma_registry)
    assert [r.getMessage() for r in caplog.records if "vision" in r.getMessage()] == [
        "skipped 2 checkpoint tensors: vision / audio towers (served text-only)"]
    assert_greedy_matches(llm, hf_model, prompts()[:1], new_tokens=NEW, atol=1e-4)


@pytest.mark.parametrize("name", ["gemma3", "gemma4_dense"])
def test_prefix_cache_hits_across_sliding_and_global_groups(name, tiny_gemma, gemma_registry):
    """Prompts sharing a 40-token prefix (past the 12-token window) hit the cache and give transformers' tokens."""
    directory, hf_model = tiny_gemma(name)
    llm = _llm(directory, gemma_registry, enable_prefix_caching=True)
    base = prompts((40,))[0]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for prompt in (base + [5, 6, 7], base + [9, 10], base[:33] + [11]):
        got = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids
        assert got == hf_greedy(hf_model, prompt, 16).sequences[0, len(prompt):].tolist()
    assert llm.engine.cache.stats()["prefix_cache_hit_tokens"] > 0
