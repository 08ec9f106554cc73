"""Kernel dispatch and tuning overlay: per-architecture overrides, supports() fallbacks, priority and tuned
ranks, the reference / triton backends, describe(), installing a table, and the stacked tuning tables
(plugin over core over defaults, a GPU's table over its capability's) with the Qwen3.6 configs unchanged."""
from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch
import triton

from armillary.errors import PluginError
from armillary.hookspecs import hookimpl
from armillary.kernels import ops, tuning
from armillary.kernels.dispatch import resolve_dispatch
from armillary.registry import PluginRegistry

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "qwen36_tuning_before.json"
TOY = "toy_dispatch_kernels"  # the test plugin's kernel module (put in sys.modules)


@pytest.fixture
def toy(monkeypatch, tmp_path):
    """A module of toy rms_norm implementations that record their calls, per-call supports checks, and
    the toy plugin's package ``toy_pkg`` with a ``tuning`` folder."""
    (tmp_path / "toy_pkg" / "tuning").mkdir(parents=True)
    (tmp_path / "toy_pkg" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = types.ModuleType(TOY)
    mod.calls = []

    def make(name):
        def rms_norm(x, weight, eps, zero_centered):
            mod.calls.append(name)
            return x * 0 + len(mod.calls)

        return rms_norm

    for name in ("fast", "faster", "picky", "tuned80"):
        setattr(mod, name, make(name))
    mod.never = lambda device, dtype, **kw: False
    mod.float32_only = lambda device, dtype, **kw: dtype in (None, torch.float32)
    monkeypatch.setitem(sys.modules, TOY, mod)
    yield mod
    ops.set_backend("auto")


def plugin(name: str, archs=(), kernels=()):
    """A plugin module registering ``archs`` [(name, hf_name)] and ``kernels`` [(name, impl attr, kwargs)]."""
    mod = types.ModuleType(name)

    @hookimpl
    def armillary_register_architectures(registry):
        for arch, hf in archs:
            registry.register(arch, [hf], f"{name}_pkg.model:Model")

    @hookimpl
    def armillary_register_kernels(registry):
        for kname, attr, kw in kernels:
            registry.register(kname, "rms_norm", f"{TOY}:{attr}", **kw)

    mod.armillary_register_architectures = armillary_register_architectures
    mod.armillary_register_kernels = armillary_register_kernels
    return mod


def registry_with(*plugins) -> PluginRegistry:
    reg = PluginRegistry()
    for i, mod in enumerate(plugins):
        reg.register(mod, f"p{i}")
    return reg


def test_override_is_chosen_for_its_architecture_only(toy):
    reg = registry_with(plugin("toy", archs=[("toy", "ToyLM"), ("other", "OtherLM")],
                               kernels=[("toy_rms_norm", "fast", dict(architectures=("toy",), kind="native"))]))
    assert reg.kernels.get("toy_rms_norm").architectures == ("toy",)
    for device, cap in (("cpu", None), ("cuda", (9, 0))):
        assert resolve_dispatch(reg, "toy", device, capability=cap).chosen("rms_norm") == "toy_rms_norm"
        other = resolve_dispatch(reg, "other", device, capability=cap)
        assert "toy_rms_norm" not in [c.spec.name for c in other.chain("rms_norm")]
    assert resolve_dispatch(reg, "other", "cpu").chosen("rms_norm") == "torch_rms_norm"
    assert resolve_dispatch(reg, "other", "cuda", capability=(9, 0)).chosen("rms_norm") == "triton_rms_norm"
    table = resolve_dispatch(reg, "toy", "cpu")
    ops.install(table)
    x = torch.randn(3, 8)
    assert torch.equal(ops.rms_norm(x, torch.ones(8), 1e-6), torch.ones(3, 8)) and toy.calls == ["fast"]
    assert ops.get_backend() == "auto" and not ops.use_triton(x)
    assert tuning.active_packages() == ("toy_pkg",)  # the architecture's plugin package overlays the tables
    ops.install(None)
    assert tuning.active_packages() == ()
    ops.rms_norm(x, torch.ones(8), 1e-6)
    assert toy.calls == ["fast"]  # back on core's default table


def test_unsupported_device_or_call_falls_back_to_the_next(toy):
    reg = registry_with(plugin("toy", kernels=[
        ("never_rms_norm", "fast", dict(kind="native", supports=f"{TOY}:never", priority=99)),
        ("picky_rms_norm", "picky", dict(kind="native", supports=f"{TOY}:float32_only")),
    ]))
    table = resolve_dispatch(reg, None, "cpu")
    assert [c.spec.name for c in table.chain("rms_norm")] == ["picky_rms_norm", "torch_rms_norm"]
    ops.install(table)
    ops.rms_norm(torch.randn(2, 4), torch.ones(4), 1e-6)
    x64 = torch.randn(2, 4, dtype=torch.float64)
    torch.testing.assert_close(ops.rms_norm(x64, torch.ones(4, dtype=torch.float64), 1e-6),
                               x64 * x64.pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt())
    assert toy.calls == ["picky"]  # the float64 call went to the reference


def test_priority_then_tuned_targets_then_references_last(toy):
    reg = registry_with(plugin("toy", kernels=[
        ("fast_rms_norm", "fast", dict(kind="native", priority=5)),
        ("faster_rms_norm", "faster", dict(kind="native", priority=7)),
        ("sm80_rms_norm", "tuned80", dict(targets=[(8, 0)])),  # Triton, tuned for sm_80 only
    ]))
    cpu = [c.spec.name for c in resolve_dispatch(reg, None, "cpu").chain("rms_norm")]
    assert cpu == ["faster_rms_norm", "fast_rms_norm", "torch_rms_norm"]  # no Triton on the CPU under auto
    sm90 = resolve_dispatch(reg, None, "cuda", capability=(9, 0))
    assert [c.spec.name for c in sm90.chain("rms_norm")] == [
        "triton_rms_norm", "faster_rms_norm", "fast_rms_norm", "sm80_rms_norm", "torch_rms_norm"]
    assert [c.tuned for c in sm90.chain("rms_norm")] == [True, True, True, False, True]
    sm80 = resolve_dispatch(reg, None, "cuda", capability=(8, 0))
    assert [c.spec.name for c in sm80.chain("rms_norm")] == [  # sm_80: the plugin's kernel is tuned, core's not
        "faster_rms_norm", "fast_rms_norm", "sm80_rms_norm", "triton_rms_norm", "torch_rms_norm"]
    forced = resolve_dispatch(reg, None, "cpu", "triton")
    assert [c.spec.name for c in forced.chain("rms_norm")][:2] == ["triton_rms_norm", "sm80_rms_norm"]


def test_backends_and_set_backend():
    reg = PluginRegistry()
    ref = resolve_dispatch(reg, None, "cuda", "reference", capability=(9, 0))
    assert all(c.spec.kind == "reference" for chain in ref.chains.values() for c in chain)
    assert ref.chosen("linear") == "torch_linear" and ref.chosen("fresh_prefill_attention") is None
    auto = resolve_dispatch(reg, None, "cuda", "auto", capability=(9, 0))
    assert auto.chosen("fresh_prefill_attention") == "sdpa_fresh_prefill" and auto.triton
    triton_cpu = resolve_dispatch(reg, None, "cpu", "triton")
    assert triton_cpu.triton and triton_cpu.chosen("fresh_prefill_attention") is None  # SDPA needs CUDA
    for name, chain in triton_cpu.chains.items():
        if name == "fresh_prefill_attention":
            continue
        assert chain[0].spec.kind == "triton" and chain[-1].spec.kind == "reference", name
    x = torch.randn(2, 8)
    try:
        ops.set_backend("triton")
        assert ops.get_backend() == "triton" and ops.use_triton(x)
        assert ops.active_table(x).chosen("rms_norm") == "triton_rms_norm"
        ops.set_backend("reference")
        assert not ops.use_triton(x) and ops.active_table(x).chosen("fused_moe") == "torch_fused_moe"
        with pytest.raises(ValueError, match="backend"):
            ops.set_backend("fast")
    finally:
        ops.set_backend("auto")
    assert ops.active_table(x).chosen("linear") == "torch_linear"


def test_describe_lines():
    reg = PluginRegistry()
    table = resolve_dispatch(reg, None, "cuda", capability=(8, 6))
    lines = table.describe()
    assert lines[0] == "linear: triton_skinny_gemm (core, untuned) then torch_linear (core)"
    assert "fresh_prefill_attention: sdpa_fresh_prefill (core)" in lines
    assert len(lines) == len(table.chains) and all(": " in line for line in lines)
    assert "backend auto" in table.header() and "sm_86" in table.header()
    assert resolve_dispatch(reg, None, "cpu", "reference").describe()[4] == "fresh_prefill_attention: none"


def test_registration_checks_and_laziness():
    def bad(**kw):
        return plugin("bad", kernels=[("k", "fast", kw)])

    with pytest.raises(PluginError, match="kind"):
        registry_with(bad(kind="cuda"))
    with pytest.raises(PluginError, match="lazy reference"):
        registry_with(bad(supports="nomodule"))
    reg = registry_with(plugin("lazy", kernels=[("k", "fast", {})]))  # TOY not imported: registration is lazy
    spec = reg.kernels.get("k")
    assert (spec.priority, spec.supports, spec.architectures, spec.kind, spec.plugin) == (0, None, (), "triton", "p0")
    with pytest.raises(PluginError, match="duplicate kernel"):
        reg.register(plugin("again", kernels=[("k", "fast", {})]), "again")


def test_gpu_name_keys():
    assert [tuning.gpu_name_key(n) for n in ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe",
                                            "NVIDIA GeForce RTX 4090", "NVIDIA GB10", "NVIDIA A100-SXM4-80GB")] \
        == ["h200", "h100", "h100", "rtx4090", "gb10", "a100"]


@pytest.fixture
def fake_gpu(monkeypatch):
    """Makes the tables see an sm_90 GPU; yields a setter for its name ("h200", or None for none)."""
    monkeypatch.setattr(tuning, "device_target", lambda device=None: "sm_90")
    name = [None]
    monkeypatch.setattr(tuning, "gpu_name", lambda device=None: name[0])

    def set_name(value):
        name[0] = value

    yield set_name


def test_tuning_overlay_order(tmp_path, monkeypatch, fake_gpu):
    tables = {
        "tcore_pkg/sm_90": {"k": {"default": {"a": 1, "b": 1, "c": 1, "d": 1}, "s1": {"b": 2}}},
        "tcore_pkg/sm_90_h200": {"k": {"default": {"c": 3}}},
        "tplug_pkg/sm_90": {"k": {"s1": {"d": 4}}, "other": {"default": {"a": 9}}},
        "tplug_pkg/sm_90_h100": {"k": {"default": {"a": 5}}},
    }
    for where, table in tables.items():
        pkg, name = where.split("/")
        (tmp_path / pkg / "tuning").mkdir(parents=True, exist_ok=True)
        (tmp_path / pkg / "__init__.py").write_text("")
        (tmp_path / pkg / "tuning" / f"{name}.json").write_text(json.dumps(table))
    monkeypatch.syspath_prepend(str(tmp_path))
    defaults = {"a": 0, "b": 0, "c": 0, "d": 0, "e": 0}

    def cfg(key="s1"):
        return tuning.kernel_config("tcore_pkg", "k", key, defaults)

    assert cfg() == {"a": 1, "b": 2, "c": 1, "d": 1, "e": 0}  # core's capability table over the defaults
    assert cfg("s2") == {"a": 1, "b": 1, "c": 1, "d": 1, "e": 0}  # no shape entry: its "default"
    fake_gpu("h200")
    assert cfg() == {"a": 1, "b": 2, "c": 3, "d": 1, "e": 0}  # the H200's own table over sm_90's
    with tuning.overlay("tplug_pkg"):
        assert cfg() == {"a": 1, "b": 2, "c": 3, "d": 4, "e": 0}  # the plugin's entry over core's
        fake_gpu("h100")
        assert cfg() == {"a": 5, "b": 2, "c": 1, "d": 4, "e": 0}  # an H100 differs from an H200
        assert tuning.kernel_config("tplug_pkg", "k", "s1", defaults)["a"] == 5  # a plugin's own kernel
    assert tuning.active_packages() == () and cfg()["d"] == 1
    assert defaults == {"a": 0, "b": 0, "c": 0, "d": 0, "e": 0}
    try:  # ARMILLARY_TUNING's table lies over every table, its "default" before its key
        tuning.use_env_table('{"k": {"default": {"e": 7, "b": 8}, "s1": {"a": 6}}}')
        with tuning.overlay("tplug_pkg"):
            assert cfg() == {"a": 6, "b": 8, "c": 1, "d": 4, "e": 7}
            assert cfg("s2")["a"] == 5
    finally:
        tuning.use_env_table("")
    assert cfg() == {"a": 1, "b": 2, "c": 1, "d": 1, "e": 0}


@pytest.mark.parametrize("text", ["{not json", '{"k": 1}', '{"k": {"s1": 2}}', "[1]"])
def test_a_malformed_tuning_environment_is_refused(text):
    with pytest.raises(ValueError, match="ARMILLARY_TUNING"):
        tuning.parse_env_table(text)


def qwen_resolved_configs() -> dict:
    """The launch configs the kernels resolve at the Qwen3.6-35B-A3B shapes (what the fixture captured)."""
    from armillary.kernels.triton import causal_conv1d as conv
    from armillary.kernels.triton import moe, norm
    from armillary.kernels.triton import paged_attention as pa
    from armillary.kernels.triton import skinny_gemm as sg
    from armillary_qwen_gdn_moe.ops.gated_delta_rule import chunk
    from armillary_qwen_gdn_moe.ops.gated_delta_rule import fused_recurrent as fr

    cpu = torch.device("cpu")
    out = {}
    for n, k in [(12352, 2048), (2048, 4096), (9216, 2048), (257, 2048), (248320, 2048), (2048, 2048), (4096, 2048)]:
        for rows in (1, 2, 3, 4, 5, 8, 9, 16, 17, 64):
            out[f"skinny_gemm/{rows}x{n}x{k}"] = sg.lookup_config(rows, n, k, cpu)
    for dtype in (torch.bfloat16, torch.float32):
        q, k_cache = torch.empty(1, 16, 256, dtype=dtype), torch.empty(1, 16, 2, 256, dtype=dtype)
        out[f"paged_attention_decode/{dtype}"] = pa._config("paged_attention_decode", pa.DECODE_DEFAULTS, q, k_cache,
                                                            None)
        out[f"paged_attention_prefill/{dtype}"] = pa._config("paged_attention_prefill", pa.PREFILL_DEFAULTS, q,
                                                             k_cache, None)
    for tokens in range(1, 17):
        out[f"fused_moe_gemv/{tokens}"] = moe.gemv_config(tokens, cpu)
    for tokens in (1, 2, 4, 8, 16, 32, 64):
        out[f"fused_moe_decode/{tokens * 9}"] = moe.decode_config(tokens * 9, cpu)
    for tokens in (16, 64, 256, 1024, 4096, 16384):
        out[f"fused_moe/{tokens * 9}"] = moe.grouped_config(tokens * 9, 257, cpu)
    for dim in (2048, 256, 128):
        out[f"rms_norm/{dim}"] = norm.launch_config(triton.next_power_of_2(dim), cpu)
    for batch in (1, 2, 4, 8, 9, 16, 32, 64, 128):
        out[f"gdn_decode/{batch}"] = fr.decode_config(batch, 128, 128, cpu)
    out["gdn_chunk"] = chunk._launch_config(128, 128, cpu, None)
    out["causal_conv1d/w4"] = tuning.kernel_config(conv.TUNING_PACKAGE, "causal_conv1d", "w4", conv.CONV_DEFAULTS, cpu)
    return out


@pytest.mark.parametrize("target", ["sm_90", "sm_121"])
@pytest.mark.parametrize("gpu", [None, "h200", "h100"])
def test_qwen36_configs_are_those_before_the_move(target, gpu, monkeypatch):
    """Captured before model shapes moved from core's tables to the plugin's: the served Qwen model resolves
    exactly the same configs; core alone no longer carries the Qwen projection / expert entries."""
    from armillary_qwen_gdn_moe import hooks

    monkeypatch.setattr(tuning, "device_target", lambda device=None: target)
    monkeypatch.setattr(tuning, "gpu_name", lambda device=None: gpu)
    expected = json.loads(FIXTURE.read_text())[target]
    reg = PluginRegistry()
    reg.register(hooks, "qwen_gdn_moe")
    table = resolve_dispatch(reg, "qwen3_5_moe", "cpu")
    assert table.tuning_packages == ("armillary_qwen_gdn_moe",)
    try:
        ops.install(table)
        assert json.loads(json.dumps(qwen_resolved_configs())) == expected
    finally:
        ops.install(None)
    if target == "sm_90":
        from armillary.kernels.triton import moe, skinny_gemm

        assert not skinny_gemm.lookup_config(1, 12352, 2048)["use"]  # core's table alone: no Qwen shapes
        assert moe.gemv_config(1)["max_tokens"] == 0
