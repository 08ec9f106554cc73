"""The launches of one Gemma 4 decode step (as a CUDA graph captures it) are the fused path, so a regression fails.

A tiny Gemma-4 MoE (and a dense model with per-layer inputs and KV sharing) runs one decode-only
batch through the Triton kernels with every launch recorded, not run (no weights needed): each
layer must be exactly the fused sequence (qkv GEMM, q/k/v norm + rope + store, attention, o GEMM,
one norm launch with the router's projection inside, gate/up GEMM, down GEMV with the GeGLU inside,
route, the GEMV experts, one tail launch), and no torch operation may compute anything between the kernels but the
step's prologue (embedding, its scale, one rotary table for both layer types). The logits are one
GEMV with the soft-cap inside. (On the GPU the fused GEMVs wait for the table's "use"; until then
each is core's GEMM and the plugin's GeGLU / soft-cap launch.)
"""
from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from armillary.cuda_graphs import CUDAGraphDecoder
from armillary.hf_config import HFConfig
from armillary.kernels import ops, tuning
from armillary.memory.planner import allocate_caches, plan_memory
from armillary_gemma.model import Gemma4ForCausalLM
from plugins.gemma.tests.gemma_hf import CONFIGS

SKINNY, ATTN = "_skinny_gemm_kernel", "_paged_attention_kernel"
ATTENTION = [SKINNY, "_qkv_norm_rope_store_kernel", ATTN, SKINNY, "_attn_out_norms_kernel"]
MLP = [SKINNY, "_gemma_gemv_kernel"]  # gate_up, then down with the GeGLU inside (the triton backend takes it)
MOE = ["_gemma4_route_kernel", "moe_gemv_up_kernel", "moe_gemv_down_kernel"]  # router GEMV: in the norms launch
TAIL = ["_layer_tail_kernel"]
# aten ops that move no data through a kernel of their own (views, allocations)
FREE = {"empty", "empty_like", "new_empty", "empty_strided", "view", "_unsafe_view", "split", "split_with_sizes",
        "slice", "select", "reshape", "as_strided", "alias", "unsqueeze", "t", "expand", "detach", "lift_fresh"}


class _AtenLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def recorded(monkeypatch):
    """Triton launches are recorded by kernel name and skipped; the "triton" backend serves every call and the
    kernels read the sm_90 tables (the plugin's over core's), as on an H100 / H200."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    launches: list[str] = []

    def record(self, *args, grid, warmup, **kwargs):
        launches.append(self.fn.__name__)

    monkeypatch.setattr(InterpretedFunction, "run", record)
    monkeypatch.setattr(JITFunction, "run", record)
    monkeypatch.setattr(tuning, "device_target", lambda device=None: "sm_90")  # the H100 / H200 tables
    monkeypatch.setattr(tuning, "gpu_name", lambda device=None: None)
    ops.set_backend("triton")
    tuning.use_packages(("armillary_gemma",))
    yield launches
    ops.set_backend("auto")


def _decode_step(name: str, batch_size: int = 2):
    """(model, a decode-only batch of ``batch_size`` rows as the CUDA-graph decoder builds it) on the CPU."""
    cfg = HFConfig(json.loads(json.dumps({**CONFIGS[name], "model_type": "gemma4_text"})))
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(cfg)
    for p in model.parameters():
        p.data.normal_()  # never read by a kernel (launches are skipped), but the prologue's torch ops run
    layout = Gemma4ForCausalLM.cache_layout(cfg)
    plan = plan_memory(layout, budget_bytes=8 << 20, block_size=4, num_slots=2, dtype=torch.float32,
                       max_model_len=64, max_num_seqs=batch_size, max_chunk=64)
    caches, _ = allocate_caches(layout, plan, torch.float32, torch.device("cpu"))
    graphs = CUDAGraphDecoder(model, caches, batch_size, 16, 4, 0, plan.num_slots - 1, torch.device("cpu"),
                              num_groups=max(1, len(plan.paged_groups)))
    batch = graphs._batch(batch_size)
    graphs.seq_lens[:batch_size] = 9  # a context longer than nothing: attention has blocks to read
    return model, batch


def _run(model, batch, launches: list[str]) -> tuple[list[str], Counter]:
    """The second forward's launches and computing aten ops (the first makes the cached device buffers)."""
    with torch.inference_mode():
        model(batch)
    launches.clear()
    log = _AtenLog()
    with torch.inference_mode(), log:
        hidden = model(batch)
    assert hidden.shape == (batch.input_ids.shape[0], model.args.hidden_size)
    return list(launches), Counter(op for op in log.ops if op not in FREE)


def _without_attention_splits(seq: list[str]) -> list[str]:
    """Long contexts add a split-combine launch to attention; at 9 tokens there is none."""
    return [k for k in seq if k != "_combine_splits_kernel"]


def test_gemma4_moe_decode_step_is_the_fused_path(recorded):
    model, batch = _decode_step("gemma4_moe")
    seq, aten = _run(model, batch, recorded)
    # layer 0's input norm, then the layers; every later input norm comes out of the previous layer's tail
    layer = ATTENTION + MLP + MOE + TAIL
    assert _without_attention_splits(seq) == ["_rms_norm_kernel"] + layer * model.args.num_layers
    # the prologue only: token embedding, its sqrt(H) scale, one cos / sin table for both layer types
    prologue = Counter(embedding=1, mul=2, cos=1, sin=1, to=3)  # ``to``: positions to float32 (and no-op casts)
    assert aten == prologue, aten


def test_gemma4_logits_are_one_soft_capped_gemv(recorded):
    model, batch = _decode_step("gemma4_moe")
    hidden = torch.randn(2, model.args.hidden_size)
    log = _AtenLog()
    with torch.inference_mode(), log:
        logits = model.compute_logits(hidden)
    assert recorded == ["_gemma_gemv_kernel"]  # the soft-cap inside the head's GEMV
    assert logits.dtype == torch.float32 and logits.shape == (2, model.args.vocab_size)
    assert not [op for op in log.ops if op not in FREE], log.ops


def test_gemma4_dense_small_model_decode_step(recorded):
    """E2B / E4B shapes: KV-shared layers (a q projection, no store) and per-layer inputs (a second tail)."""
    model, batch = _decode_step("gemma4_dense")
    seq, _ = _run(model, batch, recorded)
    seq = _without_attention_splits(seq)
    shared = set(model.shared_layers)
    tails = [k for k in seq if k == "_layer_tail_kernel"]
    assert len(tails) == 2 * model.args.num_layers  # the MLP tail, then the per-layer-input tail with the scalar
    assert seq.count("_qkv_norm_rope_store_kernel") == model.args.num_layers - len(shared)
    assert seq.count("_attn_out_norms_kernel") == model.args.num_layers
    assert seq.count(ATTN) == model.args.num_layers
    assert "_norm_add_norm_kernel" not in seq and "_qk_norm_rope_store_kernel" not in seq
