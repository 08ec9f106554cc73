"""The decode step's folded launches at odd sizes: ``q_a_layernorm`` inside the q_b GEMV (``norm_gemv``) against
its float32 reference and the unfused norm + GEMM, and the one-launch router (``router_topk``) against the
two-launch path it replaces (``router_logits`` then core's Triton ``topk_sigmoid_bias``): the same ids,
exact ties included, plain, group-limited and with shared columns."""
from __future__ import annotations

import pytest
import torch

from armillary.kernels.norm import rms_norm
from armillary.kernels.triton.device_buffers import ticket_buffer
from armillary.kernels.triton.moe_routing import topk_sigmoid_bias
from armillary.testing.offline_ptx import assert_prefetch_before_wait, kernel_ptx
from armillary_glm_flash.ops import norm_gemv as ng
from armillary_glm_flash.ops.router import router_logits
from armillary_glm_flash.ops.router_topk import MAX_ROWS, router_topk

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter evaluates masked-off lanes
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HALF = torch.bfloat16 if torch.cuda.is_available() else torch.float16  # the interpreter's bf16 tl.dot is wrong


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_norm_gemv_matches_norm_then_gemm(rows, dtype):
    g = torch.Generator().manual_seed(rows)
    k, n = 63, 60
    x = torch.randn(rows, k + 17, generator=g).to(dtype).to(DEVICE)[:, :k]  # a strided view, as q_a of qkv_a
    norm_w = (1 + 0.3 * torch.randn(k, generator=g)).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(dtype).to(DEVICE)
    want = ng.norm_gemv_ref(x, norm_w, 1e-6, w)
    pair = rms_norm(x, norm_w, 1e-6).float() @ w.float().t()  # the unfused norm (rounded to dtype) + GEMM
    tol = 2e-6 if dtype == torch.float32 else 1e-2
    for cfg in ({"path": "fma", "BLOCK_N": 8, "BLOCK_K": 32}, {"path": "fma", "BLOCK_N": 16, "BLOCK_K": 64},
                {"path": "dot", "BLOCK_N": 16, "BLOCK_K": 32}):
        got = ng.norm_gemv(x, norm_w, 1e-6, w, config=cfg)
        assert got.shape == (rows, n) and got.dtype == dtype
        assert _rel(got, want) < tol, f"{cfg}: {_rel(got, want):.2e} vs the fp32 reference"
        assert _rel(got, pair) < tol, f"{cfg}: {_rel(got, pair):.2e} vs norm + GEMM"


def test_norm_gemv_serves_decode_rows_of_one_dtype(monkeypatch):
    from armillary.kernels import ops

    monkeypatch.setattr(ops, "use_triton", lambda x: True)
    monkeypatch.setattr(ops, "get_backend", lambda: "triton")
    x, norm_w, w = torch.zeros(8, 63), torch.ones(63), torch.zeros(60, 63)
    assert ng.serves(x, norm_w, w)
    assert not ng.serves(torch.zeros(9, 63), norm_w, w)  # more than max_rows: the norm + GEMM pair
    assert not ng.serves(x, norm_w, w.half())  # weight in another dtype
    assert not ng.serves(x, torch.ones(62), w)
    monkeypatch.setattr(ops, "get_backend", lambda: "auto")
    assert not ng.serves(x, norm_w, w)  # auto: only shapes a table marks "use": true


def _pair(x, w, bias, top_k, renorm, scaling, shared, groups):
    return topk_sigmoid_bias(router_logits(x, w), bias, top_k, renorm, scaling, shared, **groups)


CASES = {  # experts, top_k, shared, renormalize, groups
    "glm-like": (64, 4, 1, True, {}),
    "odd-experts": (6, 2, 2, False, {}),
    "grouped": (8, 3, 1, True, {"n_group": 4, "topk_group": 2}),
    "grouped-wide": (16, 4, 0, True, {"n_group": 4, "topk_group": 3}),
}


@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS])
@pytest.mark.parametrize("case", list(CASES))
def test_router_topk_equals_the_two_launch_path(rows, case):
    experts, top_k, shared, renorm, groups = CASES[case]
    g = torch.Generator().manual_seed(rows * 100 + experts)
    k = 63
    x = torch.randn(rows, k + 5, generator=g).to(DEVICE)[:, :k]
    w = (torch.randn(experts, k, generator=g) * k ** -0.5).to(DEVICE)
    bias = (torch.randn(experts, generator=g) * 0.05).to(DEVICE)
    # exact ties: twin experts (same weight row and bias: bit-equal logits) across and inside groups, and a row of
    # zeros with equal biases, where every expert and every group ties
    w[1], bias[1] = w[0], bias[0]
    w[-1], bias[-1] = w[-3], bias[-3]
    tied_bias = torch.zeros_like(bias)
    for b in (bias, tied_bias):
        for xs in (x, torch.cat((torch.zeros(1, k, device=DEVICE), x[1:]))):
            want_w, want_ids = _pair(xs, w, b, top_k, renorm, 1.8, shared, groups)
            got_w, got_ids = router_topk(xs, w, b, top_k, renorm, 1.8, shared, **groups)
            assert got_ids.dtype == torch.int32 and got_ids.shape == (rows, top_k + shared)
            assert torch.equal(got_ids, want_ids.to(torch.int32)), (got_ids, want_ids)
            torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=0)
    assert not ticket_buffer(torch.device(DEVICE), 1)[0].item()  # the last arriver reset its ticket


def test_router_topk_ties_pick_lower_ids():
    x, w = torch.zeros(2, 63, device=DEVICE), torch.randn(8, 63, device=DEVICE)
    bias = torch.zeros(8, device=DEVICE)
    _, ids = router_topk(x, w, bias, 3, True, 1.0, 1, n_group=4, topk_group=2)
    assert ids.tolist() == [[0, 1, 2, 8]] * 2  # every group and expert ties: the first ones, then the shared one
    with pytest.raises(ValueError, match="at most"):
        router_topk(torch.zeros(MAX_ROWS + 1, 63, device=DEVICE), w, bias, 3, True)


def test_router_topk_row_limit_comes_from_the_table(monkeypatch):
    """Without a table every decode-sized step takes the one launch; the sm_90 table turns it off (timed slower
    on the H200), so the MoE block keeps router_logits + sigmoid_topk there."""
    from armillary.kernels import tuning
    from armillary_glm_flash.ops import router_topk as rt

    assert rt.max_rows(torch.device("cpu")) == MAX_ROWS
    monkeypatch.setattr(tuning, "device_target", lambda device=None: "sm_90")
    monkeypatch.setattr(tuning, "gpu_name", lambda device=None: None)
    assert rt.max_rows(torch.device("cpu")) == 0


@pytest.mark.parametrize("use_dot", [False, True])
def test_norm_gemv_prefetches_its_weights_before_the_pdl_wait_on_sm90(use_dot):
    """Compiled offline for sm_90 with PDL and PREFETCH: W's L2 prefetches sit between launch and wait."""
    consts = {"ROWS": 16 if use_dot else 1, "BLOCK_N": 64 if use_dot else 8, "BLOCK_K": 256, "USE_DOT": use_dot,
              "DOT_PRECISION": "tf32", "EVEN_K": True, "PDL": True, "PREFETCH": True}
    signature = {"x_ptr": "*bf16", "nw_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16",
                 **{k: "i32" for k in ("M", "N", "K", "stride_xm", "stride_wn", "stride_om")}, "eps": "fp32",
                 **{k: "constexpr" for k in consts}}
    assert_prefetch_before_wait(kernel_ptx("armillary_glm_flash.ops.norm_gemv", "_norm_gemv_kernel", signature, consts),
                                prefetch=True)
