"""Regenerate the kernel tuning tables on this GPU: run the sweeps, merge their picks into the tables.

Each sweep below times its candidate launch configs on this device and writes the configs it would
ship; this script runs them one after another (each in its own process), collects those entries
and merges them into this GPU's own table (``sm_90_h200.json`` on an H200; ``--generic``: the
capability's ``sm_90.json``, which every sm_90 GPU reads beneath its own). By default each sweep times the
Qwen3.6 shapes, so its entries go to the Qwen plugin's ``tuning/`` (model shapes stay out of
core's tables, which keep the generic entries); ``--model nemotron|glm|gemma4|gemma3|all`` runs the
skinny-GEMM, GEMV-MoE and grouped-MoE sweeps (for Nemotron also the Mamba decode split sweep, for
Gemma the paged-attention decode sweep) at that plugin model's shapes instead and merges into that plugin's ``tuning/``. Entries of kernels no sweep covers (attention
tiles, GDN chunk / conv tiles: picked by hand from ``attention_kernels.py`` and ``gdn_kernels.py``)
are kept as they are.

    python bench/autotune.py --out DIR            # merged tables in DIR/tuning/, package files untouched
    python bench/autotune.py --out DIR --write    # also overwrite the package tables
    python bench/autotune.py --out DIR --generic  # the capability's table instead of this GPU's
    python bench/autotune.py --out DIR --smoke    # CPU: each sweep's interpreter smoke run, tables for "cpu"
    python bench/autotune.py --out DIR --model all --generic   # the plugin models' sm_90 entries
"""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
QWEN = "armillary_qwen_gdn_moe"
NEMOTRON = "armillary_nemotron"


def _moe_tuned(result: dict) -> dict:
    """moe_kernels.py --tune: the best grouped config per rows-per-expert bucket and decode key."""
    entries = {}
    if result.get("tune_grouped"):
        entries["fused_moe"] = {key: best["config"] for key, best in result["tune_grouped"].items()}
    if result.get("tune_decode"):
        entries["fused_moe_decode"] = {key: best["config"] for key, best in result["tune_decode"].items()}
    return entries


@dataclass(slots=True)
class Sweep:
    script: str
    args: list[str]
    package: str | None  # whose tuning folder the entries go to
    result: str  # the JSON file the sweep writes into its --out directory
    entries: Callable[[dict], dict]  # result -> {kernel: entry} (with package None: {package: {kernel: entry}})
    by_shape: bool = False  # replace only the shapes it swept (a plugin of two models swept one at a time)
    by_key: bool = False  # replace only the keys it wrote (head dims: Gemma 3 and Gemma 4 share a table)


SWEEPS = [
    Sweep("skinny_gemm.py", [], QWEN, "skinny_gemm_table.json", lambda r: r),
    Sweep("moe_gemv.py", [], QWEN, "moe_gemv.json", lambda r: {"fused_moe_gemv": r["table"]} if r.get("table") else {}),
    Sweep("moe_kernels.py", ["--tune"], QWEN, "moe_kernels.json", _moe_tuned),
    Sweep("gdn_decode_sweep.py", [], QWEN, "gdn_decode_sweep.json",
          lambda r: {"gdn_decode": r["recommended"]["gdn_decode"]} if r.get("recommended") else {}),
    Sweep("attention_decode_sweep.py", ["--model", "qwen"], QWEN, "attention_decode_sweep.json",
          lambda r: {"paged_attention_decode": r["table"]} if r.get("table") else {}),
    # FP8 decode (block-fp8 checkpoints): entries only where the sweep beat the current pick, so keys merge
    Sweep("fp8_skinny_sweep.py", [], QWEN, "fp8_skinny_table.json", lambda r: r, by_key=True),
    Sweep("fp8_moe_gemv_sweep.py", [], QWEN, "fp8_moe_gemv_table.json", lambda r: r, by_key=True),
    Sweep("fp8_moe_grouped_sweep.py", [], QWEN, "fp8_moe_grouped_table.json", lambda r: r, by_key=True),
    # NVFP4 decode and grouped MoE (weight-only e2m1 checkpoints), the same way
    Sweep("fp4_skinny_sweep.py", [], QWEN, "fp4_skinny_table.json", lambda r: r, by_key=True),
    Sweep("fp4_moe_gemv_sweep.py", [], QWEN, "fp4_moe_gemv_table.json", lambda r: r, by_key=True),
    Sweep("fp4_moe_grouped_sweep.py", [], QWEN, "fp4_moe_grouped_table.json", lambda r: r, by_key=True),
]


def _attention_sweep(model: str) -> Sweep:
    return Sweep("attention_decode_sweep.py", ["--model", model], None, "attention_decode_sweep.json",
                 lambda r: {r["package"]: {"paged_attention_decode": r["table"]}} if r.get("table") else {},
                 by_key=True)


def plugin_sweeps(model: str) -> list[Sweep]:
    """The sweeps at a plugin model's shapes; their results name the packages (``None`` package)."""
    both = model == "all"
    sweeps = [
        Sweep("skinny_gemm.py", ["--model", model], None, "skinny_gemm_tables.json", lambda r: r, by_shape=True),
        Sweep("moe_gemv.py", ["--model", model], None, "moe_gemv_tables.json" if both else "moe_gemv.json",
              (lambda r: r) if both else (lambda r: {r["package"]: {"fused_moe_gemv": r["table"]}} if r.get("table")
                                          else {})),
    ]
    if model not in ("gemma3", "all"):  # gemma3 is dense; the grouped sweep takes one model at a time
        sweeps.append(Sweep("moe_grouped_sweep.py", ["--model", model], None, "moe_grouped_sweep.json",
                            lambda r: {r["package"]: {"fused_moe": r["table"]}} if r.get("table") else {}))
    if model in ("gemma4", "gemma3"):  # core's paged attention decodes them: their head dims' splits
        sweeps.append(_attention_sweep(model))
    if model in ("nemotron", "all"):
        sweeps.append(Sweep("../plugins/nemotron/bench/mamba_decode_sweep.py", [], NEMOTRON, "mamba_decode_sweep.json",
                            lambda r: {"mamba_decode": r["table"]} if r.get("table") else {}))
    if model == "gemma3":  # dense: no MoE sweeps
        sweeps = [s for s in sweeps if s.script in ("skinny_gemm.py", "attention_decode_sweep.py")]
    return sweeps


def target(generic: bool = False) -> str:
    """The table this GPU's sweeps go to: ``sm_90_h200`` (``sm_90`` when ``generic``); ``cpu`` without CUDA."""
    import torch

    from armillary.kernels.tuning import device_targets

    names = device_targets(torch.device("cuda") if torch.cuda.is_available() else None)
    return names[0] if generic else names[-1]


def table_path(package: str, name: str) -> Path:
    return Path(str(resources.files(package).joinpath("tuning", f"{name}.json")))


def render(table: dict) -> str:
    """One line per entry key, as the checked-in tables are written."""
    lines = ["{"]
    items = list(table.items())
    for i, (kernel, entry) in enumerate(items):
        comma = "," if i < len(items) - 1 else ""
        if not isinstance(entry, dict):
            lines.append(f"  {json.dumps(kernel)}: {json.dumps(entry)}{comma}")
            continue
        lines.append(f"  {json.dumps(kernel)}: {{")
        keys = list(entry.items())
        for j, (key, value) in enumerate(keys):
            lines.append(f"    {json.dumps(key)}: {json.dumps(value)}{',' if j < len(keys) - 1 else ''}")
        lines.append("  }" + comma)
    lines.append("}")
    return "\n".join(lines) + "\n"


def merge(table: dict, entries: dict, source: str, by_shape: bool = False, by_key: bool = False) -> dict:
    """``table`` with each kernel's entry replaced by the sweep's, stamped with where it came from.

    ``by_shape`` (skinny-GEMM keys ``n{N}_k{K}_m{M}``): the old keys of shapes the sweep did not time
    stay, and ``max_rows`` is the larger of the two (Gemma 3 then Gemma 4 into the gemma plugin's table);
    ``by_key``: every old key the sweep did not write stays, and the old comment leads the new one."""
    merged = dict(table)
    for kernel, entry in entries.items():
        new = {"_comment": f"{source}, {datetime.date.today()}", **entry}
        old = table.get(kernel) or {}
        if by_shape and old:
            swept = {key.rsplit("_m", 1)[0] for key in entry if key.startswith("n")}
            kept = {key: v for key, v in old.items() if key.startswith("n") and key.rsplit("_m", 1)[0] not in swept}
            rows = [d.get("max_rows") for d in (old.get("default", {}), entry.get("default", {})) if d.get("max_rows")]
            new = {**new, **kept, **({"default": {**entry.get("default", {}), "max_rows": max(rows)}} if rows else {})}
        if by_key and old:  # the old comment stays as the entry's history, the new one after it
            history = f"{old['_comment']}; then " if old.get("_comment") else ""
            new = {"_comment": history + new["_comment"], **{k: v for k, v in old.items() if k != "_comment"},
                   **{k: v for k, v in new.items() if k != "_comment"}}
        merged[kernel] = new
    return merged


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--write", action="store_true", help="overwrite the package tables of this target")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter runs of the sweeps (checks the plumbing)")
    ap.add_argument("--only", nargs="*", default=None, help="sweep scripts to run (default: all)")
    ap.add_argument("--generic", action="store_true", help="write the capability's table (sm_90), not this GPU's")
    ap.add_argument("--model", default="qwen", choices=("qwen", "nemotron", "glm", "gemma4", "gemma3", "all"),
                    help="whose shapes: qwen (default: every sweep) or a plugin model (its GEMM / MoE / Mamba sweeps)")
    args = ap.parse_args()
    if args.write and args.smoke:
        ap.error("--write with --smoke would write interpreter timings into the tables")
    name = target(args.generic)
    tables: dict[str, dict] = {}
    for sweep in SWEEPS if args.model == "qwen" else plugin_sweeps(args.model):
        if args.only is not None and Path(sweep.script).name not in args.only:
            continue
        out = args.out / Path(sweep.script).stem
        cmd = [sys.executable, str(HERE / sweep.script), "--out", str(out), *sweep.args, *(["--smoke"] if args.smoke else [])]
        print("$", " ".join(cmd[1:]), flush=True)
        proc = subprocess.run(cmd, cwd=HERE.parent)
        result_file = out / sweep.result
        if proc.returncode != 0 or not result_file.exists():
            print(f"  {sweep.script} failed (exit {proc.returncode}); its entries stay as they are", flush=True)
            continue
        entries = sweep.entries(json.loads(result_file.read_text()))
        per_package = entries if sweep.package is None else {sweep.package: entries}
        for package, kernels in per_package.items():
            print(f"  -> {package}/tuning/{name}.json: {sorted(kernels)}", flush=True)
            if package not in tables:
                path = table_path(package, name)
                tables[package] = json.loads(path.read_text()) if path.exists() else {}
            tables[package] = merge(tables[package], kernels, f"bench/{Path(sweep.script).name}", sweep.by_shape,
                                    sweep.by_key)
    for package, table in tables.items():
        text = render(table)
        review = args.out / "tuning" / package / f"{name}.json"
        review.parent.mkdir(parents=True, exist_ok=True)
        review.write_text(text)
        print(f"wrote {review}", flush=True)
        if args.write:
            table_path(package, name).write_text(text)
            print(f"wrote {table_path(package, name)}", flush=True)


if __name__ == "__main__":
    main()
