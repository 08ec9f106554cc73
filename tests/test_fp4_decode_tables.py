"""The NVFP4 decode launch tables: ``fp4_skinny`` and ``fp4_moe_gemv`` entries change the launch and stay correct against ``armillary.kernels.fp4`` (odd sizes, interpreter), and the two sweeps' CPU smoke runs write their entry into a table."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from armillary.kernels import fp4 as ref
from armillary.kernels import tuning
from armillary.kernels.triton import fp4_gemv, fp4_moe

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


def _ratio(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _set_table(monkeypatch, table: dict) -> None:
    """Every package's tables answer ``table`` (a fresh function each time: kernel_config's memo keys on it)."""
    monkeypatch.setattr(tuning, "load_table", lambda package, target: table)


@pytest.mark.parametrize("m,entry,changed", [
    (1, {"BLOCK_N": 4, "BLOCK_K": 32, "num_warps": 2, "split_k": 2}, ("BLOCK_N", "BLOCK_K", "split_k", "num_warps")),
    (3, {"DOT_BLOCK_N": 16, "DOT_BLOCK_K": 64, "dot_num_warps": 2, "split_k": 1}, ("BLOCK_N", "BLOCK_K", "num_warps")),
])
def test_skinny_entry_changes_the_launch_and_stays_correct(monkeypatch, m, entry, changed):
    n, k = 63, 160  # odd rows (clamped), K tiles past K (masked)
    torch.manual_seed(m)
    packed, scale, g = ref.quantize_nvfp4(torch.randn(n, k))
    g = ref.row_global_scale(g, n) * torch.linspace(0.5, 2.0, n)
    x = torch.randn(m, k)
    _set_table(monkeypatch, {})
    default = fp4_gemv.decode_config(m, n, k, CPU)
    _set_table(monkeypatch, {"fp4_skinny": {"_comment": "test", fp4_gemv.config_key(m, n, k): entry}})
    tuned = fp4_gemv.decode_config(m, n, k, CPU)
    assert all(tuned[key] != default[key] for key in changed), (default, tuned)
    assert fp4_gemv.decode_config(m, n + 1, k, CPU) == default  # another shape's key: the defaults
    want = ref.linear(x, packed, scale, g, None)
    for _ in range(2):  # split K: the second call starts from the reset tickets
        assert _ratio(fp4_gemv.fp4_skinny_gemm(x, packed, scale, g), want) < 1e-5



@pytest.mark.parametrize("entry,split", [({"BLOCK_N": 4, "BLOCK_K": 16, "split_k": 5}, 5),  # 2 tiles a split
                                         ({"BLOCK_N": 8, "BLOCK_K": 16, "split_k": 3}, 3),  # 4, the last past K
                                         ({"BLOCK_N": 4, "BLOCK_K": 32, "split_k": 5}, 5)])  # 1 already
def test_skinny_preload_merges_the_k_tiles_and_stays_correct(monkeypatch, entry, split):
    """``preload`` (one row): a program's K tiles become one tile, loaded before the PDL wait; sums as the
    reference across split K, a tile past K and clamped rows; several rows keep their own path."""
    n, k = 63, 160
    torch.manual_seed(split)
    packed, scale, g = ref.quantize_nvfp4(torch.randn(n, k))
    g = ref.row_global_scale(g, n)
    x = torch.randn(1, k)
    _set_table(monkeypatch, {"fp4_skinny": {fp4_gemv.config_key(1, n, k): entry}})
    loop = fp4_gemv.decode_config(1, n, k, CPU)
    _set_table(monkeypatch, {"fp4_skinny": {fp4_gemv.config_key(1, n, k): {**entry, "preload": True}}})
    cfg = fp4_gemv.decode_config(1, n, k, CPU)
    assert cfg["preload"] and cfg["K_TILES"] == 1 and cfg["split_k"] == loop["split_k"] == split
    assert cfg["BLOCK_K"] == loop["BLOCK_K"] * loop["K_TILES"]
    want = ref.linear(x, packed, scale, g, None)
    for _ in range(2):
        assert _ratio(fp4_gemv.fp4_skinny_gemm(x, packed, scale, g), want) < 1e-5
    with pytest.raises(ValueError, match="inconsistent"):  # a preload over several K tiles is refused, not run
        fp4_gemv.fp4_skinny_gemm(x, packed, scale, g, config={"preload": True, "K_TILES": 2})
    _set_table(monkeypatch, {"fp4_skinny": {fp4_gemv.config_key(3, n, k): {**entry, "preload": True}}})
    assert not fp4_gemv.decode_config(3, n, k, CPU)["preload"]
    _set_table(monkeypatch, {"fp4_skinny": {fp4_gemv.config_key(1, n, k): {"BLOCK_K": 32, "split_k": 1,
                                                                            "preload": True}}})
    odd = fp4_gemv.decode_config(1, n, k, CPU)  # five tiles: not a power of two wide, so the loop stays
    assert not odd["preload"] and odd["K_TILES"] == 5

def _moe(tokens: int, seed: int = 0, routed: int = 5, top_k: int = 1, h: int = 80, inter: int = 48):
    """NVFP4 experts (``routed`` + the shared one as the last id) and Qwen's routing layout."""
    g = torch.Generator().manual_seed(seed)
    p13, s13, g13 = ref.quantize_nvfp4(torch.randn(routed + 1, 2 * inter, h, generator=g))
    p2, s2, g2 = ref.quantize_nvfp4(torch.randn(routed + 1, h, inter, generator=g))
    experts = (p13, s13, ref.row_global_scale(g13, 2 * inter), p2, s2, ref.row_global_scale(g2, h))
    picked = torch.stack([torch.randperm(routed, generator=g)[:top_k] for _ in range(tokens)])
    ids = torch.cat((picked, torch.full((tokens, 1), routed)), dim=1).to(torch.int32)  # [T, k + 1]
    weights = torch.rand(tokens, top_k + 1, generator=g)
    return torch.randn(tokens, h, generator=g), experts, weights, ids


GEMV_CONFIGS = [  # rows straddling I / H (clamped), K tiles under and past K, one row per program
    {"BLOCK_N1": 8, "BLOCK_K1": 32, "num_warps1": 2, "BLOCK_N2": 16, "BLOCK_K2": 16, "num_warps2": 1},
    {"BLOCK_N1": 1, "BLOCK_K1": 512, "num_warps1": 1, "BLOCK_N2": 32, "BLOCK_K2": 64, "num_warps2": 2},
]


@pytest.mark.parametrize("cfg", GEMV_CONFIGS)
def test_moe_gemv_under_config_matches_reference(cfg):
    x, experts, weights, ids = _moe(2, seed=len(cfg))
    out = fp4_moe.fp4_fused_moe(x, *experts, weights, ids, "silu", grouped=False, gemv=cfg)
    assert _ratio(out, ref.fused_moe(x, *experts, weights, ids, "silu")) < 1e-5


def test_moe_gemv_entry_reaches_the_launch(monkeypatch):
    key = fp4_moe.gemv_config_key(6, 80, 48, 2, 3)
    assert key == "e6_h80_i48_k2_t4"
    _set_table(monkeypatch, {})
    assert fp4_moe.gemv_config(6, 80, 48, 2, 3, CPU) == fp4_moe.INTERPRETER_DEFAULTS
    assert fp4_moe.GEMV_DEFAULTS == {"BLOCK_N1": 4, "BLOCK_K1": 2048, "num_warps1": 2, "BLOCK_N2": 8,
                                     "BLOCK_K2": 1024, "num_warps2": 4}  # the launch before the table existed
    _set_table(monkeypatch, {"fp4_moe_gemv": {"_comment": "test", key: GEMV_CONFIGS[0],
                                              "e6_h80_i48_k2_t2": {"BLOCK_N1": 3}}})
    assert fp4_moe.gemv_config(6, 80, 48, 2, 3, CPU) == {**fp4_moe.INTERPRETER_DEFAULTS, **GEMV_CONFIGS[0]}
    x, experts, weights, ids = _moe(3, seed=4)
    assert _ratio(fp4_moe.fp4_fused_moe(x, *experts, weights, ids, "silu"),
                  ref.fused_moe(x, *experts, weights, ids, "silu")) < 1e-5
    with pytest.raises(Exception, match="power of 2"):  # t2's entry is launched: its 3 rows a program fail
        fp4_moe.fp4_fused_moe(x[:2], *experts, weights[:2], ids[:2], "silu")


def _shipped() -> Path:
    from importlib import resources

    return Path(str(resources.files("armillary.kernels").joinpath("tuning", "sm_90.json")))


def _run(script: str, out: Path, *extra: str) -> None:
    table = out / "sm_90.json"
    shutil.copy(_shipped(), table)
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--tiny", "--device", "cpu", "--out", str(out),
                           "--write", "--table", str(table), "--min-gain=-1000", "--deadline-s", "1000", *extra],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _others_kept(merged: dict, kernel: str) -> None:
    shipped = json.loads(_shipped().read_text())
    assert {k: v for k, v in merged.items() if k != kernel} == {k: v for k, v in shipped.items() if k != kernel}
    assert {k: v for k, v in shipped.get(kernel, {}).items() if k != "_comment"}.items() <= merged[kernel].items()


def test_skinny_sweep_smoke_writes_its_entry(tmp_path):
    _run("fp4_skinny_sweep.py", tmp_path)
    results = json.loads((tmp_path / "fp4_skinny_sweep.json").read_text())
    assert set(results["model_shapes"]) == {"n2048_k4096", "n9216_k2048", "n12352_k2048"}
    configs = [c for row in results["rows"] for c in row["configs"]]
    assert all(c.get("ok") for c in configs), [c for c in configs if not c.get("ok")]
    assert {c["config"]["USE_DOT"] for c in configs} == {False, True}
    assert {c["config"]["split_k"] for c in configs if c["source"] == "sweep"} == {1, 2}
    merged = json.loads((tmp_path / "sm_90.json").read_text())
    swept = json.loads((tmp_path / "fp4_skinny_table.json").read_text())["fp4_skinny"]
    assert len([k for k in swept if k != "_comment"]) == len(results["rows"]) == 4
    assert all(merged["fp4_skinny"][k] == v for k, v in swept.items() if k != "_comment")
    _others_kept(merged, "fp4_skinny")


def test_moe_gemv_sweep_smoke_writes_its_entry(tmp_path):
    _run("fp4_moe_gemv_sweep.py", tmp_path, "--tokens", "1")
    results = json.loads((tmp_path / "fp4_moe_gemv_sweep.json").read_text())["results"]
    (r,) = results
    assert r["complete"] and r["current"]["pair"]["ok"] and r["bf16"]["pair"]["ok"]
    assert all(x["ok"] for kind in ("up", "down") for x in r["rows"][kind]) and all(r["rows"].values())
    entry = json.loads((tmp_path / "fp4_moe_gemv_table.json").read_text())["fp4_moe_gemv"]
    assert list(entry) == ["e6_h80_i48_k3_t1"]
    assert set(entry["e6_h80_i48_k3_t1"]) == set(fp4_moe.GEMV_DEFAULTS)  # both kernels won at --min-gain -1000
    merged = json.loads((tmp_path / "sm_90.json").read_text())
    assert merged["fp4_moe_gemv"]["e6_h80_i48_k3_t1"] == entry["e6_h80_i48_k3_t1"]
    _others_kept(merged, "fp4_moe_gemv")
    other = tmp_path / "other.json"  # --merge (no sweep): the run's key beside a key already there
    other.write_text(json.dumps({"fp4_moe_gemv": {"e9_h1_i1_k1_t1": {"BLOCK_N2": 2}}, "fp4_skinny": {"default": {}}}))
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "fp4_moe_gemv_sweep.py"), "--merge",
                           str(tmp_path / "fp4_moe_gemv_table.json"), "--table", str(other)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(other.read_text())
    assert got["fp4_skinny"] == {"default": {}} and got["fp4_moe_gemv"]["e9_h1_i1_k1_t1"] == {"BLOCK_N2": 2}
    assert got["fp4_moe_gemv"]["e6_h80_i48_k3_t1"] == entry["e6_h80_i48_k3_t1"]
    assert got["fp4_moe_gemv"]["_comment"].startswith("bench/fp4_moe_gemv_sweep.py on cpu-interpreter")
