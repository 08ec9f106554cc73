"""A broken installed plugin (import or hook failure) is skipped with one warning and never hides the others."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from armillary.errors import PluginError
from armillary.registry import PluginRegistry
from tests.fixtures.broken_plugins import HOOK_ERROR, HOOK_FAILS, IMPORT_ERROR, IMPORT_FAILS, write_broken_plugins


@pytest.fixture
def broken_on_path(tmp_path, monkeypatch):
    root = write_broken_plugins(tmp_path / "site")
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delenv("ARMILLARY_DISABLE_PLUGINS", raising=False)
    for name in (f"{IMPORT_FAILS}_hooks", f"{HOOK_FAILS}_hooks"):
        sys.modules.pop(name, None)
    yield root
    for name in (f"{IMPORT_FAILS}_hooks", f"{HOOK_FAILS}_hooks"):
        sys.modules.pop(name, None)


def test_broken_plugins_are_skipped_and_remembered(broken_on_path, caplog):
    reg = PluginRegistry()
    with caplog.at_level(logging.WARNING, logger="armillary"):
        reg.load_entry_points()
    assert {"qwen_gdn_moe", "llama"} <= set(reg.infos)  # the working plugins still load
    assert set(reg.broken) == {IMPORT_FAILS, HOOK_FAILS}
    imp, hook = reg.broken[IMPORT_FAILS], reg.broken[HOOK_FAILS]
    assert imp.entry_point == f"{IMPORT_FAILS}_hooks" and imp.error == f"ImportError: {IMPORT_ERROR}"
    assert imp.distribution == f"armillary-{IMPORT_FAILS}" and imp.version == "1.0"
    assert hook.error == f"RuntimeError: {HOOK_ERROR}"
    # what the hook registered before it raised is gone: no half-registered plugin
    assert HOOK_FAILS not in reg.infos and "brokenhook_arch" not in reg.architectures
    assert reg.pm.get_plugin(HOOK_FAILS) is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for name, error in ((IMPORT_FAILS, IMPORT_ERROR), (HOOK_FAILS, HOOK_ERROR)):
        lines = [w for w in warnings if repr(name) in w]
        assert len(lines) == 1, warnings
        assert error in lines[0] and f"ARMILLARY_DISABLE_PLUGINS={name}" in lines[0]


def test_an_architecture_nobody_serves_names_the_broken_plugins(broken_on_path):
    reg = PluginRegistry()
    reg.load_entry_points()
    assert reg.resolve_architecture(["Qwen3NextForCausalLM"]).name == "qwen3_next"
    with pytest.raises(PluginError) as err:
        reg.resolve_architecture(["BrokenHookForCausalLM"])
    message = str(err.value)
    assert "broken plugin" in message and IMPORT_ERROR in message and HOOK_ERROR in message
    assert f"{IMPORT_FAILS} ({IMPORT_FAILS}_hooks)" in message


def test_disabled_broken_plugin_is_neither_loaded_nor_reported(broken_on_path, monkeypatch):
    monkeypatch.setenv("ARMILLARY_DISABLE_PLUGINS", f"{IMPORT_FAILS},{HOOK_FAILS}")
    reg = PluginRegistry()
    reg.load_entry_points()
    assert reg.broken == {} and {"qwen_gdn_moe", "llama"} <= set(reg.infos)


def test_armillary_plugins_lists_broken_ones_and_exits_0(broken_on_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(broken_on_path), os.environ.get("PYTHONPATH", "")])}
    env.pop("ARMILLARY_DISABLE_PLUGINS", None)
    done = subprocess.run([sys.executable, "-m", "armillary.cli", "plugins"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "qwen_gdn_moe" in out and "architecture qwen3_next" in out and "llama" in out
    assert f"{IMPORT_FAILS}  (armillary-{IMPORT_FAILS} 1.0)  BROKEN, skipped" in out
    assert f"error: ImportError: {IMPORT_ERROR}" in out and f"error: RuntimeError: {HOOK_ERROR}" in out
    assert f"disable it with ARMILLARY_DISABLE_PLUGINS={HOOK_FAILS}" in out
    assert "Traceback" not in done.stderr
    assert sum(f"{IMPORT_FAILS}_hooks" in line for line in done.stderr.splitlines()) == 1  # one warning line


def test_version_flag_and_attribute():
    import armillary
    from importlib.metadata import version

    assert armillary.__version__ == version("armillary")
    done = subprocess.run([sys.executable, "-m", "armillary.cli", "--version"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == f"armillary {armillary.__version__}"
