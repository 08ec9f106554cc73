"""The armillary Qwen GDN models, loaded from transformers-saved checkpoints, against transformers itself:
logits at every step, greedy continuations, batched / chunked / mixed steps, checkpoint layouts, MTP."""
from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch

from armillary.cache_spec import FullAttention, Recurrent
from armillary.errors import WeightLoadError
from armillary.testing import (
    assert_batched_greedy,
    assert_logits_close as _assert_close,
    assert_stepwise_greedy,
    lazy_references,
    swap_expert_layout,
)
from armillary_qwen_gdn_moe.weights import QwenWeightLoader
from plugins.qwen_gdn_moe.tests.harness import Harness, build_model
from plugins.qwen_gdn_moe.tests.hf_models import (
    CASES,
    CASES_BY_NAME,
    NEW_TOKENS,
    Case,
    F,
    make_reference,
    read_checkpoint,
    write_checkpoint,
)

MOE_CASES = [c for c in CASES if c.is_moe]
CG_CASES = [c for c in CASES if c.is_conditional_generation]


def ids(cases: list[Case]) -> list[str]:
    return [c.name for c in cases]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return lazy_references(make_reference, tmp_path_factory)


def assert_logits_close(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    _assert_close(got, ref, what, tol=5e-5)


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_greedy_decode_matches_generate(case, references):
    """Each prompt alone: prompt logits, every decode step's logits and all 32 greedy tokens."""
    ref = references(case)
    assert_stepwise_greedy(Harness(ref.model_dir), ref, NEW_TOKENS, assert_logits_close)


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_batched_prefill_then_batched_decode(case, references):
    """All four prompts prefilled in one batch, then decoded together."""
    ref = references(case)
    assert_batched_greedy(Harness(ref.model_dir), ref, NEW_TOKENS, assert_logits_close)


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_chunked_prefill_mixed_with_decodes(case, references):
    """A 100-token prompt prefilled in two chunks (the second beside another prompt's prefill),
    then decodes sharing steps with a third prompt's prefill; fed transformers' tokens."""
    ref = references(case)
    harness = Harness(ref.model_dir)
    long_, short, single = 3, 1, 0
    long_prompt = ref.prompts[long_]
    harness.step([(long_, long_prompt[:37])])
    logits = harness.step([(long_, long_prompt[37:]), (short, ref.prompts[short])])
    assert_logits_close(logits[0], ref.logits[long_][0], "long prompt after second chunk")
    assert_logits_close(logits[1], ref.logits[short][0], "short prompt prefilled beside it")
    logits = harness.step([(long_, ref.tokens[long_][:1]), (single, ref.prompts[single]), (short, ref.tokens[short][:1])])
    assert_logits_close(logits[0], ref.logits[long_][1], "long decode step 1")
    assert_logits_close(logits[1], ref.logits[single][0], "one-token prompt prefilled among decodes")
    assert_logits_close(logits[2], ref.logits[short][1], "short decode step 1")
    fed = {long_: 1, short: 1, single: 0}  # generated tokens already fed back
    for _ in range(5):
        order = (long_, short, single)
        logits = harness.step([(s, ref.tokens[s][fed[s] : fed[s] + 1]) for s in order])
        for row, s in enumerate(order):
            fed[s] += 1
            assert_logits_close(logits[row], ref.logits[s][fed[s]], f"prompt {s} decode {fed[s]}")


@pytest.mark.parametrize("case", MOE_CASES, ids=ids(MOE_CASES))
def test_both_expert_layouts_load_identically(case, references, tmp_path):
    ref = references(case)
    saved = read_checkpoint(ref.model_dir)
    # transformers 5.x save_pretrained reverts its fused experts to the per-expert checkpoint names
    assert any(re.search(r"\.experts\.0\.gate_proj\.weight$", n) for n in saved)
    fused = swap_expert_layout(saved)
    assert any(n.endswith(".experts.gate_up_proj") for n in fused)
    write_checkpoint(tmp_path, fused, source=ref.model_dir)
    per_expert_model, _ = build_model(ref.model_dir)
    fused_model, _ = build_model(tmp_path)
    for (name, a), (_, b) in zip(per_expert_model.named_parameters(), fused_model.named_parameters()):
        assert torch.equal(a, b), name
    harness = Harness(tmp_path)
    for seq in (2, 3):
        assert_logits_close(harness.step([(seq, ref.prompts[seq])])[0], ref.logits[seq][0], f"fused layout prompt {seq}")


def _mtp_tensors(case: Case, saved: dict[str, torch.Tensor], hidden: int) -> dict[str, torch.Tensor]:
    """Random ``mtp.*`` tensors in the checkpoint layout: norms, fc, one full-attention layer, norm."""
    gen = torch.Generator().manual_seed(7)
    prefix = "model.language_model.layers." if case.is_conditional_generation else "model.layers."
    full_layer = case.text["layer_types"].index(F)
    tensors = {
        "mtp.pre_fc_norm_embedding.weight": torch.randn(hidden, generator=gen),
        "mtp.pre_fc_norm_hidden.weight": torch.randn(hidden, generator=gen),
        "mtp.fc.weight": torch.randn(hidden, 2 * hidden, generator=gen),
        "mtp.norm.weight": torch.randn(hidden, generator=gen),
    }
    layer_prefix = f"{prefix}{full_layer}."
    for name, t in saved.items():
        if name.startswith(layer_prefix):
            tensors["mtp.layers.0." + name[len(layer_prefix):]] = torch.randn(t.shape, generator=gen)
    return tensors


def _landed(model, params: dict, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """What the loader wrote for checkpoint tensor ``name`` (stacked parameters hold several);
    loading it again writes the same values, and says where."""
    (param_name, index), = QwenWeightLoader(model, tie_word_embeddings=False).loader.load(name, tensor)
    return params[param_name][index]


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_mtp_weights_land_in_the_mtp_module(case, references, tmp_path):
    ref = references(case)
    saved = read_checkpoint(ref.model_dir)
    config = json.loads((ref.model_dir / "config.json").read_text())
    text = config["text_config"] if case.is_conditional_generation else config
    text["mtp_num_hidden_layers"] = 1
    mtp = _mtp_tensors(case, saved, case.text["hidden_size"])
    write_checkpoint(tmp_path, {**saved, **mtp}, config=config)
    model, _ = build_model(tmp_path)
    assert model.mtp is not None and len(model.mtp.layers) == 1
    params = dict(model.named_parameters())
    experts = re.compile(r"^(mtp\.layers\.0\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
    for name, t in mtp.items():
        if m := experts.match(name):
            e, proj = int(m[2]), m[3]
            if proj == "down":
                got = params[f"{m[1]}.down_proj"][e]
            else:
                stacked = params[f"{m[1]}.gate_up_proj"][e]
                got = stacked.chunk(2)[0 if proj == "gate" else 1]
        else:
            got = _landed(model, params, name, t)
        assert torch.equal(got, t), name
    # the main model is unaffected by the MTP head
    harness = Harness(tmp_path)
    assert_logits_close(harness.step([(0, ref.prompts[2])])[0], ref.logits[2][0], "with MTP weights")


@pytest.mark.parametrize("case", [CASES_BY_NAME["next_full_last"], CASES_BY_NAME["moe35_cg"]], ids=["next", "moe35_cg"])
def test_unknown_checkpoint_tensor_is_an_error(case, references, tmp_path):
    ref = references(case)
    tensors = read_checkpoint(ref.model_dir)
    tensors["model.layers.0.mystery_proj.weight"] = torch.zeros(3, 3)
    write_checkpoint(tmp_path, tensors, source=ref.model_dir)
    with pytest.raises(WeightLoadError, match=r"model\.layers\.0\.mystery_proj\.weight"):
        build_model(tmp_path)


@pytest.mark.parametrize("case", CG_CASES, ids=ids(CG_CASES))
def test_vision_tower_is_skipped_with_one_log_line(case, references, caplog):
    ref = references(case)
    assert any(n.startswith("model.visual.") for n in read_checkpoint(ref.model_dir))
    with caplog.at_level(logging.INFO, logger="armillary_qwen_gdn_moe.weights"):
        build_model(ref.model_dir)
    vision_lines = [r for r in caplog.records if "vision" in r.getMessage()]
    assert len(vision_lines) == 1


def test_cache_layout_per_layer(references):
    case = CASES_BY_NAME["next_full_first_dense_layer_tied"]
    model, config = build_model(references(case).model_dir)
    layout = type(model).cache_layout(config)
    conv_dim = 2 * 1 * 24 + 3 * 16  # q ‖ k ‖ v channels
    gdn = Recurrent(shapes=((conv_dim, 3), (3, 24, 16)), dtypes=(None, torch.float32))
    attention = FullAttention(1, 16)
    assert layout == [attention, gdn, gdn, attention]


def test_qwen3_next_config_without_layer_types_or_rope_parameters(references, tmp_path):
    """Original Qwen3-Next config.json style: full_attention_interval, top-level rope fields."""
    ref = references(CASES_BY_NAME["next_full_last"])  # layers [L, L, F] = interval 3
    config = json.loads((ref.model_dir / "config.json").read_text())
    del config["layer_types"]
    rope = config.pop("rope_parameters")
    config.update(full_attention_interval=3, rope_theta=rope["rope_theta"],
                  partial_rotary_factor=rope["partial_rotary_factor"], rope_scaling=None)
    shutil.copy(ref.model_dir / "model.safetensors", tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(config))
    harness = Harness(tmp_path)
    assert_logits_close(harness.step([(0, ref.prompts[3])])[0], ref.logits[3][0], "legacy config")


@pytest.mark.parametrize("case", [CASES_BY_NAME["moe35_cg"], CASES_BY_NAME["next_full_last"]], ids=["moe35_cg", "next"])
def test_bfloat16_model_runs_with_float32_decay_and_state(case, references):
    ref = references(case)
    harness = Harness(ref.model_dir, dtype=torch.bfloat16)
    model = harness.model
    gdn = next(layer.linear_attn for layer in model.model.layers if layer.is_linear)
    assert gdn.A_log.dtype == torch.float32 and gdn.dt_bias.dtype == torch.float32
    assert gdn.in_proj.weight.dtype == torch.bfloat16
    assert model.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    logits = harness.step([(0, ref.prompts[3])])[0]
    for step in range(3):
        assert logits.dtype == torch.float32
        rel = ((logits - ref.logits[3][step]).norm() / ref.logits[3][step].norm()).item()
        assert rel < 0.05, f"bf16 step {step}: relative logits error {rel:.3f}"
        logits = harness.step([(0, ref.tokens[3][step : step + 1])])[0]
