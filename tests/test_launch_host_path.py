"""The host side of a kernel launch: the grid helpers wrappers use instead of Triton's constexpr functions, and
``kernel_config``'s memo (asked ~420 times per eager prefill step)."""
from __future__ import annotations

import torch

from armillary.kernels import tuning
from armillary.kernels.triton.host import cdiv, next_power_of_2


def test_grid_helpers_match_tritons():
    import triton

    for n in [*range(0, 300), 1023, 1024, 1025, 65535, 65536, 65537, 2**40 + 3]:
        assert next_power_of_2(n) == triton.next_power_of_2(n)
        for d in (1, 3, 16, 64, 128):
            assert cdiv(n, d) == triton.cdiv(n, d)


def test_kernel_config_memo_answers_like_the_tables(monkeypatch):
    cpu = torch.device("cpu")
    tuning._CONFIGS.clear()
    reads = []

    def table_one(package, target):
        reads.append(target)
        return {"k": {"default": {"a": 1}, "s": {"by": {"x": 1}}}}

    monkeypatch.setattr(tuning, "load_table", table_one)
    defaults = {"a": 0, "b": 0}
    first = tuning.kernel_config("pkg", "k", "s", defaults, cpu)
    assert first == {"a": 1, "b": 0, "by": {"x": 1}}
    first["by"]["x"] = 99  # callers may change their copy (nested entries too)
    first["a"] = 7
    again = tuning.kernel_config("pkg", "k", "s", defaults, cpu)
    assert again == {"a": 1, "b": 0, "by": {"x": 1}} and len(reads) == 1  # remembered, and unchanged
    assert tuning.kernel_config("pkg", "k", "s", {"a": 0, "b": 5}, cpu)["b"] == 5  # other defaults: asked again
    assert len(reads) == 2
    nested = {"a": 0, "by": {"x": 0}}
    assert tuning.kernel_config("pkg", "k2", "s", nested, cpu)["by"] == {"x": 0}
    nested["by"]["x"] = 4  # defaults edited in place (a test patching a module's table of defaults)
    assert tuning.kernel_config("pkg", "k2", "s", nested, cpu)["by"] == {"x": 4}
    monkeypatch.setattr(tuning, "load_table", lambda package, target: {"k": {"s": {"a": 3}}})
    assert tuning.kernel_config("pkg", "k", "s", defaults, cpu) == {"a": 3, "b": 0}  # a swapped loader is read
    tuning._CONFIGS.clear()
