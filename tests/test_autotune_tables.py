"""bench/autotune.py's table handling: merged entries replace only their kernels, and the checked-in
tables are in the layout it writes (so a regenerated table diffs line by line)."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("autotune", ROOT / "bench" / "autotune.py")
autotune = importlib.util.module_from_spec(spec)
sys.modules["autotune"] = autotune  # its dataclass resolves annotations through sys.modules
spec.loader.exec_module(autotune)


def test_merge_replaces_swept_kernels_and_keeps_the_rest():
    table = {"_comment": "top", "paged_attention_decode": {"d256": {"BLOCK_N": 32}}, "skinny_gemm": {"old": {}}}
    merged = autotune.merge(table, {"skinny_gemm": {"default": {"max_rows": 16}}}, "bench/skinny_gemm.py")
    assert merged["paged_attention_decode"] == table["paged_attention_decode"]
    assert merged["skinny_gemm"]["default"] == {"max_rows": 16} and "old" not in merged["skinny_gemm"]
    assert merged["skinny_gemm"]["_comment"].startswith("bench/skinny_gemm.py")
    assert json.loads(autotune.render(merged)) == merged


@pytest.mark.parametrize("path", sorted((ROOT / "core" / "kernels" / "tuning").glob("sm_90*.json"))
                         + sorted((ROOT / "plugins").glob("*/*/tuning/sm_90*.json")), ids=str)
def test_checked_in_tables_are_in_the_written_layout(path):
    text = path.read_text()
    assert autotune.render(json.loads(text)) == text


def test_sweeps_write_the_plugin_tables_of_this_gpu():
    """The sweeps time Qwen3.6 shapes: their entries go to the plugin's tables, never core's."""
    assert {sweep.package for sweep in autotune.SWEEPS} == {"armillary_qwen_gdn_moe"}
    if not torch.cuda.is_available():
        assert autotune.target() == autotune.target(generic=True) == "cpu"  # no GPU name off CUDA


def test_moe_tune_results_become_table_entries():
    result = {"tune_grouped": {"r512": {"ms": 2.1, "tokens": 16384, "config": {"BLOCK_M": 128}}},
              "tune_decode": {"p16": {"ms": 0.02, "config": {"BLOCK_N1": 32}}}}
    assert autotune._moe_tuned(result) == {"fused_moe": {"r512": {"BLOCK_M": 128}},
                                           "fused_moe_decode": {"p16": {"BLOCK_N1": 32}}}


def test_grouped_moe_sweep_entries_reach_the_plugin_table(tmp_path):
    """bench/moe_grouped_sweep.py's CPU smoke run: the winners compute what the defaults do, and autotune
    files its table under the plugin's ``fused_moe`` kernel."""
    import subprocess

    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "moe_grouped_sweep.py"), "--out", str(tmp_path),
                           "--model", "nemotron", "--smoke"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "moe_grouped_sweep.json").read_text())
    assert result["package"] == "armillary_nemotron" and {r["bucket"] for r in result["rows"]} == {"r8", "r32"}
    assert all(r["rel_err_vs_defaults"] < 1e-2 for r in result["rows"] if r["config"] is not None)
    assert set(result["table"]) <= {"r8", "r32"}
    sweep = next(s for s in autotune.plugin_sweeps("nemotron") if s.script == "moe_grouped_sweep.py")
    entries = sweep.entries({**result, "table": {"r8": {"BLOCK_M": 16}}})
    assert entries == {"armillary_nemotron": {"fused_moe": {"r8": {"BLOCK_M": 16}}}}
    assert not any(s.script == "moe_grouped_sweep.py" for s in autotune.plugin_sweeps("gemma3"))


def test_attention_decode_sweep_entries_keep_other_head_dims(tmp_path):
    """bench/attention_decode_sweep.py's CPU smoke run writes a result autotune files under the plugin's
    ``paged_attention_decode``, keeping the head dims another model of the same plugin swept."""
    import subprocess

    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "attention_decode_sweep.py"), "--out", str(tmp_path),
                           "--model", "gemma4", "--smoke"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "attention_decode_sweep.json").read_text())
    assert result["package"] == "armillary_gemma"
    assert all(row["rel_err"] < 1e-4 for r in result["results"] for row in r["rows"])  # any split: the same math
    sweep = next(s for s in autotune.plugin_sweeps("gemma3") if s.script == "attention_decode_sweep.py")
    entries = sweep.entries({**result, "table": {"d128": {"split_min_tokens": 64}}})
    old = {"paged_attention_decode": {"d256": {"split_min_tokens": 32}}}
    merged = autotune.merge(old, entries["armillary_gemma"], "bench/attention_decode_sweep.py", by_key=sweep.by_key)
    assert merged["paged_attention_decode"]["d256"] == {"split_min_tokens": 32}
    assert merged["paged_attention_decode"]["d128"] == {"split_min_tokens": 64}
