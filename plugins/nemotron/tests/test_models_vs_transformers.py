"""Tiny random ``nemotron_h`` checkpoints (three layer patterns, 1 / 2 / 4 Mamba groups, a
group-limited router, SSD chunks shorter than the prompts) through armillary's offline API against
transformers: greedy tokens and every logits row, one at a time, batched, chunked and preempted,
bf16, the cache layout and the weight loader's errors."""
from __future__ import annotations

import json

import pytest
import torch

from armillary import LLM, SamplingParams
from armillary.cache_spec import FullAttention, Recurrent
from armillary.errors import WeightLoadError
from armillary.testing import (
    LogitsRecorder,
    greedy_params,
    max_relative_error,
    read_checkpoint,
    run_staggered,
    write_checkpoint,
)
from plugins.nemotron.tests.hf_models import CASES, CASES_BY_NAME, NEW_TOKENS, make_reference, nemotron_registry


@pytest.fixture(scope="module", params=CASES, ids=[c.name for c in CASES])
def reference(request, tmp_path_factory):
    return make_reference(request.param, tmp_path_factory.mktemp("nemotron"))


def greedy(n: int = NEW_TOKENS) -> SamplingParams:
    return greedy_params(n)


def llm_for(model_dir, **kw) -> LLM:
    return LLM(str(model_dir), registry=nemotron_registry(), dtype=kw.pop("dtype", "float32"), max_model_len=256,
               **kw)


def test_one_at_a_time_matches_transformers(reference):
    """Each prompt alone: all 32 greedy tokens, every logits row to fp32 tolerance."""
    llm = llm_for(reference.model_dir)
    rec = LogitsRecorder(llm.engine.model)
    for i, (prompt, tokens, logits) in enumerate(zip(reference.prompts, reference.tokens, reference.logits)):
        out = llm.generate({"prompt_token_ids": prompt}, greedy())[0].outputs[0]
        assert out.token_ids == tokens, f"prompt {i} ({len(prompt)} tokens): greedy continuation differs"
        err = max_relative_error(rec.take(), logits)
        assert err < 2e-5, f"prompt {i}: relative logits error {err:.2e}"


def test_batched_prefill_and_decode_match_one_at_a_time(reference):
    llm = llm_for(reference.model_dir)
    outs = llm.generate([{"prompt_token_ids": p} for p in reference.prompts], greedy())
    assert [o.outputs[0].token_ids for o in outs] == reference.tokens


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_staggered_chunked_preempted_batch_matches_one_at_a_time(reference, async_scheduling):
    # a 16-token budget < the longest prompt (100); 20 blocks x 8 = 160 tokens cannot hold all four
    llm = llm_for(reference.model_dir, max_num_batched_tokens=16, block_size=8, num_kv_blocks=20, max_num_seqs=4,
                  async_scheduling=async_scheduling)
    engine = llm.engine
    done = run_staggered(engine, reference.prompts, greedy(), every=3)  # a new request every third step
    assert engine.scheduler.num_preemptions > 0
    assert (engine.num_async_steps > 0) == async_scheduling
    assert done == reference.tokens
    stats = engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["state_slots_used"] == 0


def test_bfloat16_runs_with_float32_ssm_state(reference):
    llm = llm_for(reference.model_dir, dtype="bfloat16")
    model = llm.engine.model
    mixer = next(b.mixer for b in model.backbone.layers if b.kind == "mamba")
    assert mixer.A_log.dtype == mixer.D.dtype == mixer.dt_bias.dtype == torch.float32
    assert mixer.in_proj.weight.dtype == torch.bfloat16
    moe = next(b.mixer for b in model.backbone.layers if b.kind == "moe")
    assert moe.gate.weight.dtype == moe.gate.e_score_correction_bias.dtype == torch.float32
    rec = LogitsRecorder(model)
    llm.generate({"prompt_token_ids": reference.prompts[3]}, greedy(3))
    for step, row in enumerate(rec.rows):
        ref = reference.logits[3][step]
        rel = ((row - ref).norm() / ref.norm()).item()
        assert rel < 0.05, f"bf16 step {step}: relative logits error {rel:.3f}"
        if step == 0:
            break  # later steps follow bf16's own tokens


def test_cache_layout_per_layer(tmp_path):
    reference = make_reference(CASES_BY_NAME["M*-EM_groups4_router_groups"], tmp_path, new_tokens=1)
    llm = llm_for(reference.model_dir)
    layout = type(llm.engine.model).cache_layout(llm.engine.hf_config)
    mamba = Recurrent(shapes=((8 * 8 + 2 * 4 * 16, 3), (8, 8, 16)), dtypes=(None, torch.float32))
    assert layout == [mamba, FullAttention(2, 16), None, None, mamba]


def test_unknown_and_missing_tensors_are_errors(tmp_path):
    ref = make_reference(CASES_BY_NAME["*MEM-_groups1_tied"], tmp_path / "src", new_tokens=1)
    tensors = read_checkpoint(ref.model_dir)
    config = json.loads((ref.model_dir / "config.json").read_text())
    extra = tmp_path / "extra"
    write_checkpoint(extra, {**tensors, "backbone.layers.1.mixer.mystery.weight": torch.zeros(2)}, config)
    with pytest.raises(WeightLoadError, match=r"backbone\.layers\.1\.mixer\.mystery\.weight"):
        llm_for(extra)
    missing = tmp_path / "missing"
    write_checkpoint(missing, {k: v for k, v in tensors.items() if not k.endswith("layers.1.mixer.D")}, config)
    with pytest.raises(Exception, match=r"mixer\.D"):
        llm_for(missing)


def test_model_prefix_names_load_like_backbone(tmp_path):
    """Checkpoints written with ``model.*`` names (transformers' module names) load the same."""
    ref = make_reference(CASES_BY_NAME["ME*ME_groups2_chunk8"], tmp_path / "src", new_tokens=4)
    tensors = read_checkpoint(ref.model_dir)
    renamed = tmp_path / "renamed"
    write_checkpoint(renamed, {("model." + k[len("backbone."):] if k.startswith("backbone.") else k): v
                               for k, v in tensors.items()}, source=ref.model_dir)
    out = llm_for(renamed).generate({"prompt_token_ids": ref.prompts[2]}, greedy(4))[0].outputs[0]
    assert out.token_ids == ref.tokens[2]
