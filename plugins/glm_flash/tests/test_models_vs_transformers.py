"""The armillary glm4_moe_lite model, loaded from transformers-saved checkpoints, against transformers itself:
logits at every step, greedy continuations, batched / chunked / mixed steps, decode steps without host
lists (as a CUDA graph stages them), both expert layouts, the cache layout."""
from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from armillary.cache_spec import LatentAttention
from armillary_glm_flash.model import Glm4MoeLiteForCausalLM
from plugins.glm_flash.tests.harness import Harness
from plugins.glm_flash.tests.hf_models import CASES, GROUPED, NEW_TOKENS, Case, Reference, make_reference


def ids(cases: list[Case]) -> list[str]:
    return [c.name for c in cases]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    built: dict[str, Reference] = {}

    def get(case: Case) -> Reference:
        if case.name not in built:
            built[case.name] = make_reference(case, tmp_path_factory.mktemp(case.name))
        return built[case.name]

    return get


def assert_logits_close(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    err = (got - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= 2e-5 * max(scale, 1.0), f"{what}: max |diff| {err:.3g} against max |logit| {scale:.3g}"


@pytest.mark.parametrize("case", [*CASES, GROUPED], ids=ids([*CASES, GROUPED]))
def test_greedy_decode_matches_generate(case, references):
    """Each prompt alone: prompt logits, every decode step's logits (steps staged as a CUDA graph stages
    them: no host lists) and all 32 greedy tokens."""
    ref = references(case)
    harness = Harness(ref.model_dir)
    for seq, prompt in enumerate(ref.prompts):
        logits = harness.step([(seq, prompt)])[0]
        tokens = []
        for step in range(NEW_TOKENS):
            assert_logits_close(logits, ref.logits[seq][step], f"prompt {seq} ({len(prompt)} tokens) step {step}")
            tokens.append(int(logits.argmax()))
            logits = harness.step([(seq, tokens[-1:])], decode_only=True)[0]
        assert tokens == ref.tokens[seq], f"prompt {seq}: greedy continuation differs"


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_batched_prefill_then_batched_decode(case, references):
    ref = references(case)
    harness = Harness(ref.model_dir)
    logits = harness.step(list(enumerate(ref.prompts)))
    tokens: list[list[int]] = [[] for _ in ref.prompts]
    for step in range(NEW_TOKENS):
        for seq in range(len(ref.prompts)):
            assert_logits_close(logits[seq], ref.logits[seq][step], f"prompt {seq} step {step}")
            tokens[seq].append(int(logits[seq].argmax()))
        logits = harness.step([(seq, t[-1:]) for seq, t in enumerate(tokens)], decode_only=True)
    assert tokens == ref.tokens


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


def _stacked_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert ``experts.E.{gate,up,down}_proj.weight`` -> transformers 5's fused ``gate_up_proj`` / ``down_proj``."""
    per_expert = re.compile(r"^(.+\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
    out: dict[str, torch.Tensor] = {}
    grouped: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name, t in tensors.items():
        if m := per_expert.match(name):
            grouped.setdefault(m[1], {})[(int(m[2]), m[3])] = t
        else:
            out[name] = t
    for prefix, parts in grouped.items():
        n = 1 + max(e for e, _ in parts)
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat((parts[e, "gate"], parts[e, "up"])) for e in range(n)])
        out[f"{prefix}.down_proj"] = torch.stack([parts[e, "down"] for e in range(n)])
    return out


def test_stacked_expert_layout_loads_identically(references, tmp_path):
    ref = references(CASES[0])
    saved = load_file(str(ref.model_dir / "model.safetensors"))
    stacked = _stacked_experts(saved)
    assert any(k.endswith("experts.gate_up_proj") for k in stacked)
    (tmp_path / "config.json").write_text((ref.model_dir / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in stacked.items()}, str(tmp_path / "model.safetensors"))
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
