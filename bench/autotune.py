"""Regenerate the kernel tuning tables on this GPU: run the sweeps, merge their picks into the tables.

Each sweep below times its candidate launch configs on this device and writes the configs it would
ship; this script runs them one after another (each in its own process), collects those entries
and merges them into this GPU's own table (``sm_90_h200.json`` on an H200; ``--generic``: the
capability's ``sm_90.json``, which every sm_90 GPU reads beneath its own). Each sweep times the
Qwen3.6 shapes, so its entries go to the Qwen plugin's ``tuning/`` (model shapes stay out of
core's tables, which keep the generic entries). Entries of kernels no sweep covers (attention
tiles, GDN chunk / conv tiles: picked by hand from ``attention_kernels.py`` and ``gdn_kernels.py``)
are kept as they are.

    python bench/autotune.py --out DIR            # merged tables in DIR/tuning/, package files untouched
    python bench/autotune.py --out DIR --write    # also overwrite the package tables
    python bench/autotune.py --out DIR --generic  # the capability's table instead of this GPU's
    python bench/autotune.py --out DIR --smoke    # CPU: each sweep's interpreter smoke run, tables for "cpu"
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
    package: str  # whose tuning folder the entries go to
    result: str  # the JSON file the sweep writes into its --out directory
    entries: Callable[[dict], dict]  # result -> {kernel: entry}


SWEEPS = [
    Sweep("skinny_gemm.py", [], QWEN, "skinny_gemm_table.json", lambda r: r),
    Sweep("moe_gemv.py", [], QWEN, "moe_gemv.json", lambda r: {"fused_moe_gemv": r["table"]} if r.get("table") else {}),
    Sweep("moe_kernels.py", ["--tune"], QWEN, "moe_kernels.json", _moe_tuned),
    Sweep("gdn_decode_sweep.py", [], QWEN, "gdn_decode_sweep.json",
          lambda r: {"gdn_decode": r["recommended"]["gdn_decode"]} if r.get("recommended") else {}),
]


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


def merge(table: dict, entries: dict, source: str) -> dict:
    """``table`` with each kernel's entry replaced by the sweep's, stamped with where it came from."""
    merged = dict(table)
    for kernel, entry in entries.items():
        merged[kernel] = {"_comment": f"{source}, {datetime.date.today()}", **entry}
    return merged


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--write", action="store_true", help="overwrite the package tables of this target")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter runs of the sweeps (checks the plumbing)")
    ap.add_argument("--only", nargs="*", default=None, help="sweep scripts to run (default: all)")
    ap.add_argument("--generic", action="store_true", help="write the capability's table (sm_90), not this GPU's")
    args = ap.parse_args()
    if args.write and args.smoke:
        ap.error("--write with --smoke would write interpreter timings into the tables")
    name = target(args.generic)
    tables: dict[str, dict] = {}
    for sweep in SWEEPS:
        if args.only is not None and sweep.script not in args.only:
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
        print(f"  -> {sweep.package}/tuning/{name}.json: {sorted(entries)}", flush=True)
        if sweep.package not in tables:
            path = table_path(sweep.package, name)
            tables[sweep.package] = json.loads(path.read_text()) if path.exists() else {}
        tables[sweep.package] = merge(tables[sweep.package], entries, f"bench/{sweep.script}")
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
