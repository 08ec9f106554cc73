"""Whether kernels chain with programmatic dependent launch (the tables decide per model and decode-graph batch, ARMILLARY_PDL overrides) and prefetch their weights before the wait (ARMILLARY_L2_PREFETCH, the tables)."""
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
    monkeypatch.delenv("ARMILLARY_L2_PREFETCH", raising=False)
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


def test_max_batch_turns_it_off_in_bigger_decode_graphs_only(gpu_like, serving):
    gpu_like[("armillary_qwen_gdn_moe", "sm_90")] = {"pdl": {"qwen3_5_moe": {"max_batch": 48}}}
    serving("qwen3_5_moe")
    with tuning.overlay("armillary_qwen_gdn_moe"):
        assert pdl.pdl_enabled(DEV)  # eager steps: no graph batch
        for b, on in ((1, True), (48, True), (64, False)):
            with pdl.graph_batch(b):
                assert pdl.pdl_enabled(DEV) is on
                assert pdl.launch_options(DEV) == ({"PDL": True, "launch_pdl": True} if on else {"PDL": False})
                with pdl.graph_batch(1):  # nested: the innermost graph counts, then the outer one again
                    assert pdl.pdl_enabled(DEV)
                assert pdl.pdl_enabled(DEV) is on
        assert pdl.pdl_enabled(DEV)
        serving("qwen3_next")  # another architecture of the plugin: no cap
        with pdl.graph_batch(64):
            assert pdl.pdl_enabled(DEV)


def test_the_environment_overrides_max_batch(gpu_like, serving, monkeypatch):
    gpu_like[("armillary_qwen_gdn_moe", "sm_90")] = {"pdl": {"default": {"max_batch": 8}}}
    monkeypatch.setenv("ARMILLARY_PDL", "1")
    with tuning.overlay("armillary_qwen_gdn_moe"), pdl.graph_batch(64):
        assert pdl.pdl_enabled(DEV)


def test_decode_graphs_capture_inside_their_batch(monkeypatch):
    """The decode-graph capturer tells the launches which batch they belong to (warm-up and capture alike)."""
    from armillary import cuda_graphs

    seen: list[int | None] = []

    class Model:
        def __call__(self, batch):
            seen.append(pdl._graph_batch)
            return batch

    class FakeGraph:
        def pool(self):
            return None

    class Capture:
        def __init__(self, graph, pool=None):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    decoder = object.__new__(cuda_graphs.CUDAGraphDecoder)
    decoder.model, decoder.buckets, decoder.pool, decoder.graphs, decoder.outputs = Model(), [1, 2, 4], None, {}, {}
    monkeypatch.setattr(decoder, "_reset_padding", lambda start: None, raising=False)
    monkeypatch.setattr(decoder, "_batch", lambda b: b, raising=False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", Capture)
    decoder.capture()
    assert seen == [4, 4, 2, 2, 1, 1] and pdl._graph_batch is None


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


def test_l2_prefetch_is_off_by_default_and_on_where_a_table_says(gpu_like, serving):
    serving("qwen3_5_moe")
    assert not pdl.l2_prefetch(DEV)
    assert pdl.launch_options(DEV, prefetch="weights") == {"PDL": True, "launch_pdl": True, "PREFETCH": False}
    assert pdl.launch_options(DEV) == {"PDL": True, "launch_pdl": True}  # kernels without the constexpr
    gpu_like[("armillary_qwen_gdn_moe", "sm_90")] = {"l2_prefetch": {"qwen3_5_moe": {"enabled": True}}}
    with tuning.overlay("armillary_qwen_gdn_moe"):
        assert pdl.l2_prefetch(DEV)
        assert pdl.launch_options(DEV, prefetch="weights") == {"PDL": True, "launch_pdl": True, "PREFETCH": True}
        with pdl.graph_batch(64):  # PDL off in this graph (max_batch): nothing to prefetch during
            gpu_like[("armillary_qwen_gdn_moe", "sm_90")]["pdl"] = {"qwen3_5_moe": {"max_batch": 8}}
            tuning._CONFIGS.clear()
            assert pdl.launch_options(DEV, prefetch="weights") == {"PDL": False, "PREFETCH": False}


@pytest.mark.parametrize("pdl_env, env, expected", [("", "1", True), ("", "0", False), ("0", "1", False)])
def test_l2_prefetch_follows_the_environment_and_needs_pdl(gpu_like, monkeypatch, pdl_env, env, expected):
    gpu_like[("armillary_qwen_gdn_moe", "sm_90")] = {"l2_prefetch": {"default": {"enabled": not expected}}}
    monkeypatch.setenv("ARMILLARY_PDL", pdl_env)
    monkeypatch.setenv("ARMILLARY_L2_PREFETCH", env)
    with tuning.overlay("armillary_qwen_gdn_moe"):
        assert pdl.l2_prefetch(DEV) is expected


def test_l2_prefetch_never_off_the_gpu(monkeypatch):
    monkeypatch.setenv("ARMILLARY_L2_PREFETCH", "1")
    assert pdl.launch_options(torch.device("cpu"), prefetch="weights") == {"PDL": False, "PREFETCH": False}


def test_expert_prefetch_chunks_cover_the_experts_within_the_budget():
    w13 = torch.empty(4, 1024, 2048, dtype=torch.float8_e4m3fn)  # 2 MiB an expert
    w2 = torch.empty(4, 2048, 512, dtype=torch.float8_e4m3fn)  # 1 MiB
    assert pdl.expert_prefetch_chunk(False, 9, (w13, w2)) == 0  # prefetches off
    chunk = pdl.expert_prefetch_chunk(True, 9, (w13, w2))  # 27 MiB: within the budget
    assert chunk % 16 == 0 and chunk * pdl.EXPERT_PREFETCH_CHUNKS >= 2 << 20
    assert pdl.expert_prefetch_chunk(True, 11, (w13, w2)) == 0  # 33 MiB: over it
    args = pdl.expert_prefetch_args(w13, w2, chunk)
    assert args["bytes_w13"] == 2 << 20 and args["expert_stride_w2"] == 1 << 20 and args["PREFETCH_EXPERTS"]
    assert pdl.expert_prefetch_args(w13, w2, 0)["PREFETCH_EXPERTS"] is False
    odd = torch.empty(4, 1000, 1001, dtype=torch.float8_e4m3fn)  # 1,001,000 bytes an expert: not 16-byte sized
    assert pdl.expert_prefetch_chunk(True, 1, (w13, odd)) == 0


def test_one_kind_of_prefetch_can_be_turned_off(gpu_like, serving, monkeypatch):
    serving("qwen3_5_moe")
    monkeypatch.setenv("ARMILLARY_L2_PREFETCH", "1")
    gpu_like[("armillary_qwen_gdn_moe", "sm_90")] = {"l2_prefetch": {"default": {"experts": False}}}
    with tuning.overlay("armillary_qwen_gdn_moe"):
        assert pdl.l2_prefetch(DEV, "weights") and pdl.l2_prefetch(DEV, "state")
        assert not pdl.l2_prefetch(DEV, "experts")
        with pytest.raises(ValueError, match="kind"):
            pdl.l2_prefetch(DEV, "everything")
