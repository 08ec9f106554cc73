"""The router's fp32 logits kernels against the naive fp32 product, at odd sizes under the Triton interpreter.

The FMA kernel (decode rows, any x dtype), the three-term tensor-core kernel (many bf16 rows), the fallback."""
from __future__ import annotations

import pytest
import torch

from armillary_nemotron.ops import router as tri_router
from armillary_nemotron.ops.router import router_logits, router_logits_ref

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter evaluates masked lanes


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


def operands(rows: int, experts: int, hidden: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=gen).to(dtype)
    weight = torch.randn(experts, hidden, generator=gen) * 0.05  # fp32, as the checkpoint keeps it
    return x, weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows,experts,hidden,block_k", [(1, 13, 37, 16), (3, 13, 100, 32), (8, 20, 70, 64),
                                                         (5, 7, 300, 1024)])
def test_fma_kernel_matches_fp32_product(rows, experts, hidden, block_k, dtype):
    """Decode rows: fp32 multiply-adds of x widened exactly, so fp32 accuracy whatever x's dtype; K tails masked."""
    x, weight = operands(rows, experts, hidden, dtype, seed=rows + hidden)
    got = router_logits(x, weight, config={"BLOCK_E": 4, "BLOCK_K": block_k})
    assert got.dtype == torch.float32 and got.shape == (rows, experts)
    assert rel_err(got, router_logits_ref(x, weight)) < 1e-6


def test_fma_kernel_reads_a_row_strided_x():
    x, weight = operands(3, 9, 40, torch.float32, seed=5)
    wide = torch.cat([x, torch.randn(3, 11)], dim=1)[:, :40]  # row stride 51, unit column stride
    assert torch.equal(router_logits(wide, weight), router_logits(x.contiguous(), weight))


@pytest.mark.parametrize("rows,experts,hidden", [(37, 20, 70), (17, 33, 129)])
def test_three_term_kernel_matches_fp32_product(rows, experts, hidden):
    """Many rows on tensor cores: W = hi + mid + lo in x's 16-bit dtype, three fp32 accumulators. Here fp16
    (the interpreter's bf16 tl.dot is not exact; bench/nemotron_gpu_checks.py checks bf16 at 1e-6 on the GPU):
    fp32-level accuracy, where a single 16-bit term of W is off by far more."""
    x, weight = operands(rows, experts, hidden, torch.float16, seed=rows)
    cfg = {**tri_router.router_config(rows), "BLOCK_T": 16, "BLOCK_E": 16, "BLOCK_K": 32}
    got = tri_router.launch(x, weight, cfg, fma=False)
    ref = router_logits_ref(x, weight)
    assert rel_err(got, ref) < 2e-6
    one_term = router_logits_ref(x, weight.to(torch.float16))
    assert rel_err(one_term, ref) > 1e-4  # what the split buys


def test_other_dtypes_at_many_rows_and_unused_entries_fall_back_to_the_fp32_gemm(monkeypatch):
    launched = []
    monkeypatch.setattr(tri_router, "_router_dot_kernel", type("NoLaunch", (), {
        "__getitem__": lambda self, grid: launched.append(grid)})())
    x, weight = operands(20, 6, 24, torch.float16, seed=1)
    assert torch.equal(router_logits(x, weight), torch.nn.functional.linear(x.float(), weight))
    assert not launched
    x = x[:3].to(torch.bfloat16)  # a row class the table turns off: cuBLAS's fp32 GEMM
    assert torch.equal(router_logits(x, weight, config={"use": False}), torch.nn.functional.linear(x.float(), weight))


def test_config_picks_fma_for_decode_rows_and_dot_beyond():
    assert all(tri_router.router_config(t)["fma_max_rows"] >= t for t in range(1, 9))
    assert tri_router.router_config(64)["BLOCK_T"] == 16 and tri_router.router_config(16384)["BLOCK_T"] == 64
