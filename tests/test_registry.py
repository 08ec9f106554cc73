"""The plugin registry: core defaults, explicit and entry-point registration, duplicates, disabling, `armillary plugins`."""
from __future__ import annotations

import subprocess
import sys
import types

import pytest

from armillary.errors import PluginError
from armillary.hookspecs import hookimpl
from armillary.registry import PluginRegistry


def make_plugin(name: str, archs=(), parsers=(), kernels=()):
    mod = types.ModuleType(name)

    @hookimpl
    def armillary_register_architectures(registry):
        for arch_name, hf in archs:
            registry.register(arch_name, hf, f"{name}:Model")

    @hookimpl
    def armillary_register_parsers(registry):
        for pname, kind in parsers:
            registry.register(pname, kind, f"{name}:Parser")

    @hookimpl
    def armillary_register_kernels(registry):
        for kname, iface in kernels:
            registry.register(kname, iface, f"{name}:kernel", targets=[(9, 0)])

    mod.armillary_register_architectures = armillary_register_architectures
    mod.armillary_register_parsers = armillary_register_parsers
    mod.armillary_register_kernels = armillary_register_kernels
    return mod


def test_core_defaults_are_a_plugin():
    reg = PluginRegistry()
    assert "core" in reg.infos
    assert "torch_paged_attention_decode" in reg.kernels
    assert reg.kernels.get("torch_paged_attention_decode").plugin == "core"


def test_register_records_owner_and_lookup():
    reg = PluginRegistry()
    reg.register(make_plugin("p1", archs=[("m1", ["M1ForCausalLM"])], parsers=[("t1", "tool")],
                             kernels=[("k1", "moe")]), "p1")
    assert reg.resolve_architecture(["Other", "M1ForCausalLM"]).name == "m1"
    assert reg.architectures.get("m1").plugin == "p1"
    assert reg.infos["p1"].architectures == ["m1"]
    assert reg.infos["p1"].parsers == ["t1"]
    assert [k.name for k in reg.kernels.for_interface("moe")] == ["k1"]
    assert reg.kernels.get("k1").targets == ((9, 0),)


def test_register_is_idempotent_for_the_same_module():
    reg = PluginRegistry()
    mod = make_plugin("p1", archs=[("m1", ["M1"])])
    reg.register(mod, "p1")
    reg.register(mod, "p1")
    assert len(reg.architectures) == 1


@pytest.mark.parametrize("kind", ["arch", "hf_arch", "parser", "kernel"])
def test_duplicates_are_errors_naming_both_plugins(kind):
    reg = PluginRegistry()
    first = {"arch": dict(archs=[("m", ["A"])]), "hf_arch": dict(archs=[("m", ["A"])]),
             "parser": dict(parsers=[("x", "tool")]), "kernel": dict(kernels=[("k", "moe")])}[kind]
    second = {"arch": dict(archs=[("m", ["B"])]), "hf_arch": dict(archs=[("other", ["A"])]),
              "parser": dict(parsers=[("x", "reasoning")]), "kernel": dict(kernels=[("k", "moe")])}[kind]
    reg.register(make_plugin("first", **first), "first")
    with pytest.raises(PluginError, match="first") as err:
        reg.register(make_plugin("second", **second), "second")
    assert "second" in str(err.value)


def test_same_reasoning_parser_name_from_two_plugins_is_an_error_and_the_first_stays():
    """Two plugins naming a reasoning parser alike (gemma4 in two plugins): no silent override either way."""
    reg = PluginRegistry()
    reg.register(make_plugin("gemma", parsers=[("gemma4", "reasoning")]), "gemma")
    with pytest.raises(PluginError) as err:
        reg.register(make_plugin("gemma_fork", parsers=[("gemma4", "reasoning")]), "gemma_fork")
    message = str(err.value)
    assert "duplicate parser 'gemma4'" in message and "'gemma'" in message and "'gemma_fork'" in message
    assert "ARMILLARY_DISABLE_PLUGINS" in message
    assert reg.parsers.get("gemma4").plugin == "gemma" and reg.parsers.get("gemma4").parser_cls == "gemma:Parser"


def test_a_plugin_re_registering_a_core_parser_name_is_an_error():
    """qwen3_coder is core's: a plugin that registers it again (an old qwen_gdn_moe) clashes with core."""
    reg = PluginRegistry()
    with pytest.raises(PluginError, match="registered by plugin 'core' and by 'old_qwen'"):
        reg.register(make_plugin("old_qwen", parsers=[("qwen3_coder", "tool")]), "old_qwen")
    assert reg.parsers.get("qwen3_coder").plugin == "core"


def test_unknown_architecture_lists_what_is_installed():
    reg = PluginRegistry()
    reg.register(make_plugin("p1", archs=[("m1", ["M1ForCausalLM"])]), "p1")
    with pytest.raises(PluginError) as err:
        reg.resolve_architecture(["NopeForCausalLM"])
    msg = str(err.value)
    assert "NopeForCausalLM" in msg and "M1ForCausalLM" in msg and "p1" in msg


def test_bad_parser_kind_rejected():
    reg = PluginRegistry()
    with pytest.raises(PluginError, match="kind"):
        reg.register(make_plugin("p", parsers=[("x", "weird")]), "p")


def test_entry_points_load_and_disable(monkeypatch):
    reg = PluginRegistry()
    reg.load_entry_points()
    assert "qwen_gdn_moe" in reg.infos
    assert reg.infos["qwen_gdn_moe"].distribution == "armillary-qwen-gdn-moe"
    monkeypatch.setenv("ARMILLARY_DISABLE_PLUGINS", "qwen_gdn_moe, other")
    reg2 = PluginRegistry()
    reg2.load_entry_points()
    assert "qwen_gdn_moe" not in reg2.infos
    with pytest.raises(PluginError, match="Qwen3NextForCausalLM"):
        reg2.resolve_architecture(["Qwen3NextForCausalLM"])


def test_armillary_plugins_command_lists_qwen():
    out = subprocess.run([sys.executable, "-m", "armillary.cli", "plugins"], capture_output=True, text=True,
                         check=True).stdout
    assert "qwen_gdn_moe  (armillary-qwen-gdn-moe 0.1.0)" in out
    for arch in ("Qwen3NextForCausalLM", "Qwen3_5MoeForConditionalGeneration", "Qwen3_5ForCausalLM"):
        assert arch in out
    assert "parser qwen3_coder (tool)" in out
    assert "kernel torch_paged_attention_decode" in out


def test_every_registered_name_resolves():
    """Lazy references of all installed plugins point at real objects (architectures, parsers, kernels, formats)."""
    reg = PluginRegistry()
    reg.load_entry_points()
    for registry in (reg.architectures, reg.parsers, reg.kernels, reg.formats):
        for spec in registry:
            assert spec.load() is not None, spec.name


def test_recipe_rebuilds_the_same_plugins_in_another_registry():
    """What a tensor-parallel rank's process imports: every hand-registered plugin by module path, core's defaults
    implied; the rebuilt registry serves the same architectures."""
    import armillary_llama.hooks as llama_hooks

    reg = PluginRegistry()
    reg.register(llama_hooks, "llama", distribution="armillary-llama")
    recipe = reg.recipe()
    assert [(module, name) for module, name, _, _ in recipe] == [("armillary_llama.hooks", "llama")]
    again = PluginRegistry.from_recipe(recipe)
    assert list(again.infos) == list(reg.infos) == ["core", "llama"]
    assert sorted(a.name for a in again.architectures) == sorted(a.name for a in reg.architectures)
    assert again.infos["llama"].version == reg.infos["llama"].version
