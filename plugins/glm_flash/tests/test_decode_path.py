"""Which kernels a glm4_moe_lite decode step calls: a regression back to cuBLAS or to the torch ops fails here.

A tiny model through the Triton kernels (backend "triton", the interpreter on the CPU): inside each decode
forward, every linear layer the step uses (all but ``kv_b_proj`` and ``q_b_proj``) reaches core's skinny GEMM
through ``ops.linear`` (which shapes and row counts it keeps on the H200 is the sm_90 table's call, checked at
the real shapes by ``test_decode_tables``), ``q_b_proj`` one ``norm_gemv`` (``q_a_layernorm`` fused), each MLA
layer makes one ``mla_absorb_rope_store`` (rope / norm /
store + q through W_UK) and one ``mla_decode_values`` (attention, split combine, W_UV into o_proj's
layout, through the per-head ``torch.bmm`` where the sm_90 table keeps it) call, each MoE layer's router one
``router_logits`` launch (the sm_90 table turns the one-launch ``router_topk`` off: slower on the H200); no ``F.linear`` or MLA reference op runs, and the greedy tokens still equal transformers'. The other absorbed paths through the same kernels (a verify-shaped step
without host lists; a short chunk after context beside a fresh prompt) equal transformers' logits.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import armillary_glm_flash.attention as attention
import armillary_glm_flash.decoder as decoder
from armillary import LLM, SamplingParams
from armillary.kernels.triton import skinny_gemm as tri_sg
from armillary.layers.linear import LinearBase
from armillary.testing import StepHarness
from armillary.testing.compare import assert_logits_close
from armillary_glm_flash.ops import norm_gemv, router as router_ops, router_topk
from plugins.glm_flash.tests.harness import build_engine, glm_registry
from plugins.glm_flash.tests.hf_models import CASES_BY_NAME, make_reference
from tests.fixtures.decode_tables import sm90_tables  # noqa: F401  (a fixture)

NEW = 3


class PathLog:
    """Calls made while a decode-only forward runs, by name (and the skinny GEMM's (N, K) per call)."""

    def __init__(self) -> None:
        self.decoding = False
        self.steps = 0
        self.calls: Counter = Counter()
        self.skinny: Counter = Counter()

    def wrap(self, monkeypatch, owner, name: str, key: str | None = None, shape: bool = False) -> None:
        target = getattr(owner, name)

        def spy(*args, **kwargs):
            if self.decoding:
                self.calls[key or name] += 1
                if shape:
                    self.skinny[tuple(args[1].shape)] += 1
            return target(*args, **kwargs)

        monkeypatch.setattr(owner, name, spy)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter evaluates masked-off lanes
def test_decode_step_kernel_path(tmp_path, sm90_tables, monkeypatch):
    ref = make_reference(CASES_BY_NAME["lora_interleaved"], tmp_path)  # a dense layer, then two MoE layers
    log = PathLog()
    forward = decoder.GlmFlashModel.forward

    def model_forward(self, batch):
        log.decoding = batch.is_decode_only
        log.steps += batch.is_decode_only
        try:
            return forward(self, batch)
        finally:
            log.decoding = False

    monkeypatch.setattr(decoder.GlmFlashModel, "forward", model_forward)
    log.wrap(monkeypatch, tri_sg, "skinny_gemm", shape=True)
    for name in ("mla_absorb_rope_store", "mla_absorb", "mla_decode_values", "mla_rope_store"):
        log.wrap(monkeypatch, attention, name)  # the kernels' wrappers, as attention.py calls them
    log.wrap(monkeypatch, router_ops, "router_logits")
    log.wrap(monkeypatch, router_topk, "router_topk")
    log.wrap(monkeypatch, norm_gemv, "norm_gemv")
    for name in ("absorb_query", "expand_values", "mla_decode_ref", "rope_store_ref"):
        log.wrap(monkeypatch, attention, name, key=f"reference {name}")
    log.wrap(monkeypatch, F, "linear", key="F.linear")
    log.wrap(monkeypatch, torch, "bmm", key="torch.bmm")

    llm = LLM(str(ref.model_dir), registry=glm_registry(), dtype="float32", device="cpu", max_model_len=128,
              kernel_backend="triton", enforce_eager=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in ref.prompts[:2]],
                        SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [t[:NEW] for t in ref.tokens[:2]]

    model = llm.engine.model
    layers = len(model.model.layers)
    moe_layers = sum(kind == "sparse" for kind in model.config.mlp_layer_types)
    # q_b_proj takes the norm-fused GEMV (q_a_layernorm inside it), every other projection the skinny GEMM
    used = Counter(tuple(m.weight.shape) for name, m in model.named_modules()
                   if isinstance(m, LinearBase) and not name.endswith(("kv_b_proj", "q_b_proj"))
                   and not name.startswith("mtp"))
    steps = log.steps
    assert steps >= NEW - 1
    assert log.skinny == Counter({shape: n * steps for shape, n in used.items()})  # every projection, every step
    # W_UV: the sm_90 table keeps the per-head bmm (the fused combine + W_UV launch timed slower on the H200);
    # the router: router_logits + sigmoid_topk (the sm_90 table keeps router_topk off: 0.85x at one row)
    assert log.calls == Counter({"skinny_gemm": sum(used.values()) * steps, "mla_absorb_rope_store": layers * steps,
                                 "mla_decode_values": layers * steps, "torch.bmm": layers * steps,
                                 "norm_gemv": layers * steps, "router_logits": moe_layers * steps})


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_verify_and_mixed_steps_through_the_kernels(tmp_path, sm90_tables, monkeypatch):
    ref = make_reference(CASES_BY_NAME["lora_interleaved"], tmp_path)
    log = PathLog()
    log.decoding = True  # count every call
    for name in ("mla_absorb_rope_store", "mla_absorb", "mla_decode_values"):
        log.wrap(monkeypatch, attention, name)
    harness = StepHarness(build_engine(ref.model_dir, block_size=8, num_kv_blocks=128, max_num_seqs=8,
                                       kernel_backend="triton"))
    layers = len(harness.model.model.layers)
    harness.step([(1, ref.prompts[1]), (3, ref.prompts[3])])
    assert not log.calls  # fresh prompts: decompressed, the plain rope store
    logits = harness.step([(1, ref.tokens[1][:3]), (3, ref.tokens[3][:3])], no_host_lists=True, all_rows=True)
    for row, (seq, k) in enumerate((s, k) for s in (1, 3) for k in range(3)):
        assert_logits_close(logits[row], ref.logits[seq][k + 1], f"prompt {seq} verify row {k}", tol=1e-4)
    assert log.calls == Counter({"mla_absorb_rope_store": layers, "mla_decode_values": layers})
    logits = harness.step([(1, ref.tokens[1][3:5]), (0, ref.prompts[0])])  # 2 tokens after context: absorbed
    assert_logits_close(logits[0], ref.logits[1][5], "two-token chunk after context", tol=1e-4)
    assert_logits_close(logits[1], ref.logits[0][0], "fresh prompt beside it", tol=1e-4)
    assert log.calls == Counter({"mla_absorb_rope_store": layers, "mla_decode_values": 2 * layers,
                                 "mla_absorb": layers})
