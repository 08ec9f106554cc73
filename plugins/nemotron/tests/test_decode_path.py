"""Which kernel each part of a Nemotron-H decode step calls, so that a layer slipping off its fast path fails CI.

One decode-only step of three sequences through the Triton path (the interpreter on the CPU), with
spies on the kernel entry points: every stacked projection (Mamba in_proj / out_proj, attention
qkv_proj / o_proj, dense MLP) exactly once through core's skinny GEMM, none through ``F.linear``;
each MoE router once through the plugin's FMA logits kernel (no cast, no fp32 GEMM); each Mamba
layer one fused decode launch (no varlen conv, no SSD scan, no ``torch.exp`` for A); each MoE
block through the GEMV experts (the relu² shared expert stacked among them, its activation
inside); only the LM head on ``F.linear``. Which of these the "auto" backend takes on an H100 /
H200 at the real shapes (cuBLAS where the sweep found it faster) is the tables' part:
``test_decode_tables.py``.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from armillary import LLM, SamplingParams
from armillary.kernels import ops
from armillary.kernels.triton import moe as tri_moe
from armillary.kernels.triton import skinny_gemm as tri_sg
from armillary.layers.linear import LinearBase
from armillary_nemotron.ops import router as tri_router
from armillary_nemotron.ops.mamba import decode as tri_decode
from armillary_nemotron.ops.mamba import ssd_scan as tri_scan
from plugins.nemotron.tests.hf_models import CASES_BY_NAME, make_reference, nemotron_registry
from tests.fixtures.decode_tables import Spy, sm90_tables  # noqa: F401 (a fixture)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter evaluates masked-off lanes


def _weight(x, weight, *args, **kwargs) -> int:
    return weight.data_ptr()


@pytest.mark.parametrize("case", ["ME*ME_groups2_chunk8", "M*-EM_groups4_router_groups"])
def test_decode_step_kernel_per_projection(case, tmp_path, monkeypatch, sm90_tables):
    """Read with the sm_90 tables (the MoE GEMV path is theirs), every shape forced onto Triton."""
    ref = make_reference(CASES_BY_NAME[case], tmp_path, new_tokens=1)
    llm = LLM(str(ref.model_dir), registry=nemotron_registry(), dtype="float32", device="cpu", max_model_len=256,
              block_size=8, kernel_backend="triton", enforce_eager=True)
    engine, model = llm.engine, llm.engine.model
    for i, prompt in enumerate(ref.prompts[:3]):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    engine.step()  # the prefills
    plan = engine.scheduler.schedule()
    assert all(c.is_decode for c in plan.chunks)
    batch = engine.runner.prepare(plan)
    assert batch.is_decode_only

    projections = {m.weight.data_ptr(): name for name, m in model.named_modules() if isinstance(m, LinearBase)}
    layers = model.backbone.layers
    routers = {layer.mixer.gate.weight.data_ptr() for layer in layers if layer.kind == "moe"}
    n_mamba, n_moe = sum(layer.kind == "mamba" for layer in layers), len(routers)
    assert projections and routers and n_mamba
    skinny = Spy(tri_sg.skinny_gemm, lambda x, w, *a, **k: (w.data_ptr(), x.shape[0]))
    dense = Spy(F.linear, _weight)
    router = Spy(tri_router.router_logits, _weight)
    fma, dot = Spy(tri_router._router_fma_kernel, None), Spy(tri_router._router_dot_kernel, None)
    decode_step = Spy(tri_decode.mamba_decode_step, lambda xbc, *a, **k: xbc.shape[0])
    scan = Spy(tri_scan.ssd_chunk_scan, lambda x, *a, **k: x.shape[0])
    conv = Spy(ops.causal_conv1d, lambda x, *a, **k: x.shape[0])
    gemv = Spy(tri_moe.moe_gemv, lambda x, *a, **k: x.shape[0])
    exp = Spy(torch.exp, lambda *a, **k: None)
    for owner, name, spy in ((tri_sg, "skinny_gemm", skinny), (F, "linear", dense),
                             (tri_router, "router_logits", router), (tri_router, "_router_fma_kernel", fma),
                             (tri_router, "_router_dot_kernel", dot),
                             (tri_decode, "mamba_decode_step", decode_step), (tri_scan, "ssd_chunk_scan", scan),
                             (ops, "causal_conv1d", conv), (tri_moe, "moe_gemv", gemv), (torch, "exp", exp)):
        monkeypatch.setattr(owner, name, spy)
    with torch.inference_mode():
        logits = model.compute_logits(model(batch))
    assert logits.shape[0] == 3

    assert sorted(projections.get(ptr, f"not a projection {ptr}") for ptr, _ in skinny.calls) == \
        sorted(projections.values())  # each projection once, and nothing else, through the skinny GEMM
    assert all(rows == 3 for _, rows in skinny.calls)
    assert dense.calls == [model.lm_head.weight.data_ptr()]  # only the head on F.linear
    assert sorted(router.calls) == sorted(routers) and len(fma.calls) == n_moe and not dot.calls
    assert decode_step.calls == [3] * n_mamba and not scan.calls and not conv.calls and not exp.calls
    assert gemv.calls == [3] * n_moe
