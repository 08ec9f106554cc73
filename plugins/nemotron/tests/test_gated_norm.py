"""The prefill's grouped gated RMSNorm kernel (z read in place) against core's reference, at odd sizes under the interpreter.

z is a column view of an in_proj-wide output; the reference is ``gated_rms_norm(norm_before_gate=False)``."""
from __future__ import annotations

import pytest
import torch

from armillary.kernels.norm import gated_rms_norm
from armillary_nemotron.ops.mamba.gated_norm import gated_group_norm

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter evaluates masked lanes


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float16, 2e-3), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("rows,dim,group,block_rows", [(1, 24, 8, 4), (7, 60, 20, 4), (13, 96, 96, 2),
                                                       (5, 30, 6, 8)])
def test_matches_core_reference_on_column_views(rows, dim, group, block_rows, dtype, tol):
    gen = torch.Generator().manual_seed(rows * dim)
    projected = torch.randn(rows, dim + 11 + dim, generator=gen).to(dtype)  # z | other columns | y-sized slot
    z = projected[:, :dim]  # a column view: row stride 2 * dim + 11
    y = torch.randn(rows, dim, generator=gen).to(dtype)
    weight = (1 + 0.3 * torch.randn(dim, generator=gen)).to(dtype)
    got = gated_group_norm(y, z, weight, 1e-5, group, config={"ROWS": block_rows})
    ref = gated_rms_norm(y.float(), z.contiguous().float(), weight.float(), 1e-5, group_size=group,
                         norm_before_gate=False)
    assert got.dtype == dtype and got.is_contiguous()
    assert rel_err(got, ref) < tol
    assert torch.equal(got, gated_group_norm(y, z.contiguous(), weight, 1e-5, group, config={"ROWS": block_rows}))


def test_rejects_groups_that_do_not_divide():
    with pytest.raises(ValueError):
        gated_group_norm(torch.zeros(2, 10), torch.zeros(2, 10), torch.ones(10), 1e-5, 4)
