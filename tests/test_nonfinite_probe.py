"""bench/nonfinite_probe.py's hooks: the first module (in call order) whose output is not finite is named, with
its inputs described; later offenders and finite calls leave it alone; ``clear`` starts over."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from nonfinite_probe import FirstNonFinite, describe  # noqa: E402


def test_names_the_first_non_finite_module():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4), torch.nn.Tanh())
    probe = FirstNonFinite(model)
    model(torch.randn(2, 4))
    assert probe.found == []
    with torch.no_grad():
        model[2].bias[1] = float("nan")
    model(torch.randn(2, 4))
    name, kind, out, inputs = probe.found[0]
    assert (name, kind) == ("2", "Linear") and len(probe.found) == 1  # not the Tanh, nor the Sequential after it
    assert out[:2] == ((2, 4), "torch.float32") and out[3] is False
    assert inputs[0][3] is True  # the Linear's input was finite: the NaN is its own
    probe.clear()
    model(torch.randn(2, 4))
    assert probe.found[0][0] == "2"
    probe.close()
    probe.clear()
    model(torch.randn(2, 4))
    assert probe.found == []  # hooks removed


def test_describe_fp8_and_integer_tensors():
    t = torch.tensor([1.0, -3.0, float("nan")]).to(torch.float8_e4m3fn)
    shape, dtype, peak, finite = describe(t)
    assert shape == (3,) and peak == 3.0 and finite is False
    assert describe(torch.arange(3)) == ((3,), "torch.int64")
