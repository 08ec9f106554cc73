"""Whether kernels chain with programmatic dependent launch: the tables decide per model, ARMILLARY_PDL overrides."""
from __future__ import annotations

import pytest
import torch

from armillary.kernels import tuning
from armillary.kernels.triton import moe_gemv, pdl


@pytest.fixture
def gpu_like(monkeypatch):
    """A device that has PDL, and tables under the test's control."""
    tables: dict[tuple[str, str], dict] = {}
    monkeypatch.setattr(pdl, "pdl_available", lambda device: True)
    monkeypatch.setattr(tuning, "device_targets", lambda device=None: ("sm_90",))
    monkeypatch.setattr(tuning, "load_table", lambda package, target: tables.get((package, target), {}))
    monkeypatch.delenv("ARMILLARY_PDL", raising=False)
    return tables


DEV = torch.device("cuda", 0)  # never touched: availability and tables are patched


@pytest.fixture
def serving(monkeypatch):
    """Serve an architecture as ``ops.install`` would set it, restored afterwards."""
    def serve(name: str | None) -> None:
        tuning.use_architecture(name)
    monkeypatch.setattr(tuning, "_architecture", tuning.active_architecture())
    return serve


def test_on_by_default_and_off_for_the_architecture_its_table_names(gpu_like, serving):
    assert pdl.pdl_enabled(DEV)
    assert pdl.launch_options(DEV) == {"PDL": True, "launch_pdl": True}
    gpu_like[("armillary_gemma", "sm_90")] = {"pdl": {"gemma4": {"enabled": False}}}
    serving("gemma4")
    assert pdl.pdl_enabled(DEV)  # another plugin's table: not in the overlay
    with tuning.overlay("armillary_gemma"):
        assert not pdl.pdl_enabled(DEV)
        assert pdl.launch_options(DEV) == {"PDL": False}
        serving("gemma3")  # the same plugin's other model keeps it
        assert pdl.pdl_enabled(DEV)
        gpu_like[("armillary_gemma", "sm_90")] = {"pdl": {"default": {"enabled": False}}}
        tuning._CONFIGS.clear()  # the memos key the patched loader, not the dict it reads
        pdl._DECIDED.clear()
        assert not pdl.pdl_enabled(DEV)  # "default": every model of the plugin


def test_ops_install_sets_the_architecture(serving):
    from armillary.kernels import ops
    from armillary.kernels.dispatch import resolve_dispatch, core_registry

    saved = ops._installed
    try:
        ops.install(resolve_dispatch(core_registry(), None, torch.device("cpu")))
        assert tuning.active_architecture() is None
        table = resolve_dispatch(core_registry(), None, torch.device("cpu"))
        table.arch_name = "gemma4"
        ops.install(table)
        assert tuning.active_architecture() == "gemma4"
    finally:
        ops.install(saved)


@pytest.mark.parametrize("value, expected", [("0", False), ("1", True)])
def test_the_environment_overrides_the_tables(gpu_like, monkeypatch, value, expected):
    gpu_like[("armillary_gemma", "sm_90")] = {"pdl": {"default": {"enabled": not expected}}}
    monkeypatch.setenv("ARMILLARY_PDL", value)
    with tuning.overlay("armillary_gemma"):
        assert pdl.pdl_enabled(DEV) is expected
    # the MoE GEMV's own per-shape flag yields to the override too
    monkeypatch.setattr(moe_gemv, "pdl_available", lambda device: True)
    assert moe_gemv._pdl({"pdl": not expected}, DEV) is expected


def test_moe_gemv_keeps_its_row_flag_without_an_override(gpu_like, monkeypatch):
    monkeypatch.setattr(moe_gemv, "pdl_available", lambda device: True)
    assert moe_gemv._pdl({"pdl": True}, DEV) and not moe_gemv._pdl({"pdl": False}, DEV)


def test_a_bad_value_is_refused(gpu_like, monkeypatch):
    monkeypatch.setenv("ARMILLARY_PDL", "yes")
    with pytest.raises(ValueError, match="ARMILLARY_PDL"):
        pdl.pdl_enabled(DEV)


def test_never_off_the_gpu(monkeypatch):
    monkeypatch.setenv("ARMILLARY_PDL", "1")
    assert not pdl.pdl_enabled(torch.device("cpu")) and pdl.launch_options(torch.device("cpu")) == {"PDL": False}
