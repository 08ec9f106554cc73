"""What the skinny decode-GEMV sweeps share (fp8_skinny_sweep, fp4_skinny_sweep): the checked timing of one launch config, a table pick patched in, their options, and the sweep-and-write driver over shapes x M.

A config's timing is µs per call in a CUDA graph, its error, bit-stability across calls and graph replays, and
split-K tickets back at 0."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable, Iterator

import torch

from autotune import merge, render
from skinny_gemm import rel_err, tickets_clear, time_calls

from armillary.kernels import tuning


def checked_timing(call: Callable[[int], torch.Tensor], copies: int, want: torch.Tensor, tol: float,
                   gbps: Callable[[float], float]) -> dict:
    """``call(i)`` runs the config on weight copy i; ``want`` is copy 0's fp32 product. ``ok``: it may count
    (bit-stable, tickets clear, error within ``tol``); a config that fails to compile or launch reports why."""
    row: dict = {}
    try:
        eager = call(0)
        again = call(0)
        us, outs = time_calls(call, copies)
        same = all(torch.equal(eager, o) for o in [again, *outs[::copies]])  # calls and graph replays
        row.update(us=us, GBps=gbps(us), err=rel_err(eager, want), stable=bool(same), tickets_clear=tickets_clear())
        row["ok"] = row["stable"] and row["tickets_clear"] and row["err"] <= tol
    except Exception as e:  # a config that does not compile or fit: report it, keep going
        row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
    return row


def add_sweep_arguments(ap: argparse.ArgumentParser, deadline_s: float) -> None:
    """The options both skinny sweeps take: results folder, --write / --table, margin, deadline, compile workers."""
    ap.add_argument("--out", default=os.environ.get("OUT"), help="results folder (default $OUT)")
    ap.add_argument("--write", action="store_true", help="merge the entry into the Qwen plugin's tuning/sm_90.json")
    ap.add_argument("--table", type=Path, default=None, help="the table --write merges into (default: the installed "
                    "Qwen plugin's tuning/sm_90.json)")
    ap.add_argument("--min-gain", type=float, default=0.03, help="a key's best must beat the current pick by this")
    ap.add_argument("--deadline-s", type=float, default=deadline_s, help="stop timing candidates after this; write "
                    "anyway")
    ap.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1), help="compile processes")


def output_folder(ap: argparse.ArgumentParser, args, interpreter: bool) -> Path:
    """--out, made; interpreter timings never reach the package's table (--write there needs --table)."""
    if not args.out:
        ap.error("--out or $OUT is required")
    if args.write and interpreter and args.table is None:
        ap.error("--write on the CPU interpreter needs --table: its timings must not reach the package's table")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return out


@contextmanager
def patched_lookup(kernels: ModuleType, entry: dict) -> Iterator[None]:
    """``kernels.lookup_config`` answers with ``entry`` over the tables' answer (its ``decode_config`` derives)."""
    saved = kernels.lookup_config
    kernels.lookup_config = lambda rows, n, k, device=None: {**saved(rows, n, k, device), **entry}
    try:
        yield
    finally:
        kernels.lookup_config = saved


@dataclass(slots=True)
class SkinnySweep:
    """One weight format's sweep: its kernel's table name and the format's own pieces."""
    script: str  # bench/<script>: names the result files and the table comment
    kernel: str  # the tuning entry written
    rows: tuple[int, ...]  # M values, smallest first (a short deadline cuts the larger ones)
    rotate_bytes: float  # weight bytes streamed between two uses of a copy (past the L2)
    weight_bytes: Callable[[int, int], int]  # (n, k) -> bytes of one copy
    make_weights: Callable[..., list]  # (n, k, copies, seed) -> copies
    dequantize: Callable[[tuple], torch.Tensor]  # one copy -> the dense weight in the activation dtype
    derive: Callable[..., dict]  # (m, n, k, entry=None) -> the launch keys decode_config gives
    candidates: Callable[[int, int, int, dict], list]  # (m, n, k, current) -> [(entry, launch keys)]
    warm_compile: Callable[[list, int, float], dict]  # (jobs, workers, budget_s) -> warm-up record
    sweep_shape: Callable[..., dict]  # (names, n, k, m, weights, dense, deadline) -> row
    summarise: Callable[[dict, float], dict]
    report_line: Callable[[dict, dict], str]

    def check_written(self, summaries: list[dict], rows: list[dict]) -> list[str]:
        """After ``--write``: the tables as a new process reads them give each written key its winner's launch keys."""
        tuning.load_table.cache_clear()
        tuning._CONFIGS.clear()  # kernel_config's memo of the tables' answers
        return [s["key"] for s, row in zip(summaries, rows)
                if "entry" in s and self.derive(row["M"], row["N"], row["K"]) != s["entry_config"]]

    def run(self, shapes: dict, results: dict, args, out: Path, table: Path, start: float) -> int:
        """Time every (shape, M), file the winners (``--write``: merged into ``table``, read back); 1 when a
        written key reads back another launch. ``results`` (device, date, pdl, ...) gains rows and summaries."""
        deadline = start + args.deadline_s
        stem = self.script.removesuffix(".py")
        weights, dense = {}, {}
        for i, (n, k) in enumerate(shapes):
            copies = max(2, math.ceil(self.rotate_bytes / self.weight_bytes(n, k)))
            weights[(n, k)] = self.make_weights(n, k, copies, seed=i)
            dense[(n, k)] = [self.dequantize(w) for w in weights[(n, k)]]
        jobs = [(n, k, m, cfg) for m in self.rows for (n, k) in shapes
                for cfg in [self.derive(m, n, k)] + [c for _, c in self.candidates(m, n, k, self.derive(m, n, k))]]
        print(f"{len(jobs)} configs to time over {len(shapes)} shapes x M {self.rows}; PDL "
              f"{'on' if results['pdl'] else 'off'}", flush=True)
        results["warm_up"] = self.warm_compile(jobs, args.workers, 0.6 * max(0.0, deadline - time.time()))
        for m in self.rows:
            for (n, k), names in shapes.items():
                row = self.sweep_shape(names, n, k, m, weights[(n, k)], dense[(n, k)], deadline)
                s = self.summarise(row, args.min_gain)
                results["rows"].append(row)
                results["summary"].append(s)
                print(self.report_line(row, s), flush=True)
                (out / f"{stem}.json").write_text(json.dumps(results, indent=1))
        entries = {s["key"]: s["entry"] for s in results["summary"] if "entry" in s}
        gains = ", ".join(f"{s['key']} {s['current_us']:.1f} -> {s['entry_us']:.1f} us" for s in results["summary"]
                          if "entry" in s and s["current_us"] is not None)
        comment = (f"bench/{self.script} on {results['device']} ({results['date']}, PDL "
                   f"{'on' if results['pdl'] else 'off'}): {' '.join(['python', *sys.argv])}; keys n{{N}}_k{{K}}_m{{rows "
                   f"rounded up to 2^i}} where the best beat the table pick by > {100 * args.min_gain:g}%: "
                   f"{gains or 'none'}")
        (out / f"{stem.removesuffix('_sweep')}_table.json").write_text(
            json.dumps({self.kernel: {"_comment": comment, **entries}}, indent=1))
        print(f"tuning entry ({len(entries)} keys): {json.dumps({self.kernel: entries})}", flush=True)
        status = 0
        if args.write:
            old = json.loads(table.read_text()) if table.exists() else {}
            tmp = table.with_name(table.name + ".tmp")
            tmp.write_text(render(merge(old, {self.kernel: entries}, comment, by_key=True)))  # other keys kept
            os.replace(tmp, table)
            bad = self.check_written(results["summary"], results["rows"]) if args.table is None else []
            results["written"] = {"table": str(table), "keys": sorted(entries), "read_back_mismatch": bad}
            print(f"wrote {len(entries)} keys into {table}; read back: {'ok' if not bad else 'MISMATCH ' + str(bad)}",
                  flush=True)
            status = 1 if bad else 0
        results["elapsed_s"] = time.time() - start
        (out / f"{stem}.json").write_text(json.dumps(results, indent=1))
        print(f"done in {results['elapsed_s']:.0f} s -> {out}", flush=True)
        return status
