"""``armillary.testing``'s own pieces that plugin suites lean on: the expert-layout rewrite, the logits checks, the recorder."""
from __future__ import annotations

import pytest
import torch

from armillary.testing import LogitsRecorder, assert_logits_close, max_relative_error, swap_expert_layout


def _per_expert(num_experts: int = 3, hidden: int = 5, inter: int = 7) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    tensors = {"model.norm.weight": torch.randn(hidden, generator=gen)}
    for e in range(num_experts):
        for proj, shape in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
            tensors[f"model.layers.1.mlp.experts.{e}.{proj}_proj.weight"] = torch.randn(shape, generator=gen)
    return tensors


def test_swap_expert_layout_stacks_and_back():
    per_expert = _per_expert()
    stacked = swap_expert_layout(per_expert)
    assert sorted(stacked) == ["model.layers.1.mlp.experts.down_proj", "model.layers.1.mlp.experts.gate_up_proj",
                               "model.norm.weight"]
    gate_up = stacked["model.layers.1.mlp.experts.gate_up_proj"]  # [E, 2I, H]: gate rows, then up rows
    assert gate_up.shape == (3, 14, 5)
    assert torch.equal(gate_up[2, 7:], per_expert["model.layers.1.mlp.experts.2.up_proj.weight"])
    assert stacked["model.layers.1.mlp.experts.down_proj"].shape == (3, 5, 7)
    back = swap_expert_layout(stacked)
    assert back.keys() == per_expert.keys() and all(torch.equal(back[k], per_expert[k]) for k in per_expert)


def test_logits_checks_scale_with_the_logits():
    ref = torch.tensor([100.0, -50.0, 3.0])
    assert_logits_close(ref + 0.004, ref, "within", tol=5e-5)  # 4e-3 <= 5e-5 x 100
    with pytest.raises(AssertionError, match=r"step 7: max \|diff\| 0\.006"):
        assert_logits_close(ref + 0.006, ref, "step 7", tol=5e-5)
    small = torch.tensor([0.1, -0.2])  # below 1 the floor holds: the tolerance is absolute
    with pytest.raises(AssertionError):
        assert_logits_close(small + 2e-5, small, "small", tol=1e-5)
    assert max_relative_error(ref + torch.tensor([0.0, 1.0, 0.0]), ref) == pytest.approx(0.01)


def test_logits_recorder_keeps_every_row_and_restores_the_model():
    class Head(torch.nn.Module):
        def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
            return hidden * 2

    head = Head()
    rec = LogitsRecorder(head)
    head.compute_logits(torch.ones(2, 3))
    head.compute_logits(torch.zeros(1, 3))
    rows = rec.take()  # [3, V]: two rows from the first call, one from the second
    assert rows.shape == (3, 3) and torch.equal(rows[0], torch.full((3,), 2.0)) and rec.rows == []
    rec.close()
    assert head.compute_logits.__func__ is Head.compute_logits
    assert rec.model is None and rec.inner is None  # nothing keeps the model alive through the recorder
