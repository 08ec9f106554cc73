"""bench/fp8_skinny_sweep.py's CPU smoke run: it times both decode paths, and the entry it merges into a table is what ``fp8_skinny.lookup_config`` and ``decode_config`` then answer."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest
import torch

from armillary.kernels import tuning
from armillary.kernels.triton import fp8_skinny

ROOT = Path(__file__).resolve().parents[1]
TABLE_KEYS = {"BLOCK_N", "BLOCK_K", "num_warps", "DOT_BLOCK_N", "DOT_BLOCK_K", "dot_num_warps", "dot_num_stages",
              "dot_unroll", "dot_scale_w", "split_k"}
PACKAGE = "fp8_skinny_sweep_table"  # a throwaway package whose tuning/cpu.json holds the swept entry


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[Path, dict, dict, dict]:
    """One smoke run with --write into a copy of the Qwen plugin's sm_90 table: (folder, results, entry, merged)."""
    out = tmp_path_factory.mktemp("fp8_skinny_sweep")
    shipped = Path(str(resources.files("armillary_qwen_gdn_moe").joinpath("tuning", "sm_90.json")))
    table = out / "sm_90.json"
    shutil.copy(shipped, table)
    # --min-gain -1000: every timed key gets an entry (interpreter timings decide nothing)
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "fp8_skinny_sweep.py"), "--smoke", "--out", str(out),
                           "--write", "--table", str(table), "--min-gain=-1000"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "fp8_skinny_sweep.json").read_text())
    entry = json.loads((out / "fp8_skinny_table.json").read_text())
    return out, results, entry, {"shipped": json.loads(shipped.read_text()), "merged": json.loads(table.read_text())}


def test_smoke_times_both_paths_and_splits(smoke):
    _, results, _, _ = smoke
    assert {f"n{n}_k{k}" for n, k in ((200, 64), (64, 64), (384, 64), (64, 128))} == set(results["model_shapes"])
    configs = [c for row in results["rows"] for c in row["configs"]]
    assert all(c.get("ok") for c in configs), [c for c in configs if not c.get("ok")]
    assert {c["config"]["USE_DOT"] for c in configs} == {False, True}
    assert {c["config"]["split_k"] for c in configs if c["source"] == "sweep"} == {1, 2}
    assert all(c["stable"] and c["tickets_clear"] and c["err"] < 1e-2 for c in configs)
    assert all(row["configs"][0]["source"] == "current" and row["cublas_us"] > 0 for row in results["rows"])


def test_entry_is_well_formed_and_merged(smoke):
    _, results, entry, tables = smoke
    swept = entry["fp8_skinny"]
    keys = [k for k in swept if k != "_comment"]
    assert len(keys) == len(results["rows"]) == 4
    for key in keys:
        m = re.fullmatch(r"n(\d+)_k(\d+)_m(\d+)", key)
        assert m and int(m[3]) & (int(m[3]) - 1) == 0, key
        assert set(swept[key]) <= TABLE_KEYS and all(isinstance(v, int) for v in swept[key].values()), swept[key]
        assert ("BLOCK_N" in swept[key]) == (m[3] == "1")
    merged, shipped = tables["merged"], tables["shipped"]
    others = lambda t: {k: v for k, v in t.items() if k != "fp8_skinny"}  # noqa: E731
    assert others(merged) == others(shipped)  # every other kernel untouched
    keys = lambda e: {k: v for k, v in e.items() if k != "_comment"}  # noqa: E731
    assert keys(merged["fp8_skinny"]) == {**keys(shipped.get("fp8_skinny", {})), **keys(swept)}  # shipped keys kept
    comment = merged["fp8_skinny"]["_comment"]  # the shipped history first, then this sweep
    assert comment.startswith(shipped["fp8_skinny"]["_comment"] + "; then bench/fp8_skinny_sweep.py on cpu-interpreter")


def test_lookup_config_answers_the_entry(smoke, tmp_path, monkeypatch):
    """The merged table, read as a plugin's, gives each key its entry and the winner's launch keys."""
    _, results, _, tables = smoke
    pkg = tmp_path / PACKAGE
    (pkg / "tuning").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "tuning" / "cpu.json").write_text(json.dumps(tables["merged"]))
    monkeypatch.syspath_prepend(str(tmp_path))
    with tuning.overlay(PACKAGE):
        for row, summary in zip(results["rows"], results["summary"]):
            m, n, k = row["M"], row["N"], row["K"]
            cfg = fp8_skinny.lookup_config(m, n, k)
            want = tables["merged"]["fp8_skinny"][summary["key"]]
            assert {key: cfg[key] for key in want} == want
            assert fp8_skinny.decode_config(m, n, k, 128, 128, torch.device("cpu")) == summary["entry_config"]


def test_deadline_still_writes(tmp_path):
    """--deadline-s 0: no candidate is timed, the current picks and cuBLAS still are, and the files are written."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "fp8_skinny_sweep.py"), "--smoke", "--out",
                           str(tmp_path), "--deadline-s", "0"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "fp8_skinny_sweep.json").read_text())
    assert all(row["truncated"] and [c["source"] for c in row["configs"]] == ["current"] for row in results["rows"])
    assert json.loads((tmp_path / "fp8_skinny_table.json").read_text())["fp8_skinny"].keys() == {"_comment"}
