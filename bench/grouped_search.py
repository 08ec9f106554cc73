"""The candidate search the quantized grouped-MoE sweeps share (fp8_moe_grouped_sweep, fp4_moe_grouped_sweep).

Per token count: for each BLOCK_M candidate the up GEMM's tiles with the down GEMM at today's, then the down
GEMM's with the best up; each run is one whole MoE call timed by ``time_us`` and checked by ``measure``
against the defaults' output; the best non-default config wins a table key only when it beats the defaults by
more than ``min_gain`` in a side-by-side re-run, and the dequant path (``time_paths``) takes the bucket where it
beats every grouped launch (``pick_variant``). Also the files both write and the table merge.
"""
from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from autotune import merge, render
from skinny_gemm import time_calls

GRAPH_TOKENS = 4096  # up to this many tokens a call is timed in a CUDA graph; above, events over eager calls
EVENT_CALLS = 10
TOL = 1e-2
SMEM = 232448  # sm_90's shared memory per block: what a tile's pipeline stages must fit in


class Tiles:
    """A GEMM tile as a tuple of launch keys (``keys``), named per GEMM in a config: ``BLOCK_N1``, ``num_warps2``."""

    def __init__(self, keys: tuple[str, ...]) -> None:
        self.names = keys

    def keys(self, tile: tuple, gemm: int) -> dict:
        return {f"{key}{gemm}": value for key, value in zip(self.names, tile)}

    def of(self, cfg: dict, gemm: int) -> tuple:
        return tuple(cfg[f"{key}{gemm}"] for key in self.names)

    def config(self, block_m: int, up: tuple, down: tuple) -> dict:
        # the variant key too: a candidate equal to the defaults (which name it) must compare equal to them
        return {"variant": "grouped", "BLOCK_M": block_m, **self.keys(up, 1), **self.keys(down, 2)}

    def text(self, cfg: dict) -> str:
        return f"BLOCK_M={cfg['BLOCK_M']} up {self.of(cfg, 1)} down {self.of(cfg, 2)}"

    def plan(self, block_ms: tuple[int, ...], defaults_at: Callable[[int], dict], tiles: list[tuple],
             fits: Callable[[int, tuple], bool]) -> list[tuple[int, list[tuple], list[tuple]]]:
        """(BLOCK_M, up tiles, down tiles) per BLOCK_M candidate, today's tiles (``defaults_at(bm)``) first."""
        out = []
        for bm in block_ms:
            up, down = self.of(defaults_at(bm), 1), self.of(defaults_at(bm), 2)
            out.append((bm, [up] + [t for t in tiles if t != up and fits(bm, t)],
                        [down] + [t for t in tiles if t != down and fits(bm, t)]))
        return out

    def first_configs(self, plans: list[list[tuple[int, list[tuple], list[tuple]]]]) -> list[dict]:
        """Every config ``search`` may time first (up candidates with today's down, and the reverse), once."""
        seen, cfgs = set(), []
        for plan in plans:
            for bm, ups, downs in plan:
                for up, down in [(u, downs[0]) for u in ups] + [(ups[0], d) for d in downs[1:]]:
                    if (bm, up, down) not in seen:
                        seen.add((bm, up, down))
                        cfgs.append(self.config(bm, up, down))
        return cfgs


def time_us(fn: Callable[[], torch.Tensor], tokens: int) -> tuple[float, torch.Tensor]:
    """µs per call of fn() and one output: wall clock off the GPU, a CUDA graph for small T, else events."""
    out = fn()
    if not out.is_cuda:
        start = time.perf_counter()
        out = fn()
        return (time.perf_counter() - start) * 1e6, out
    if tokens <= GRAPH_TOKENS:
        us, outs = time_calls(lambda i: fn(), 1)
        return us, outs[0]
    return events_us(fn), out


def events_us(fn: Callable[[], object], calls: int = EVENT_CALLS) -> float:
    """µs per eager call of fn() between two CUDA events, after one warm call (no graph: for calls that size
    themselves on the host)."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def median_event_us(fn: Callable[[], object], reps: int = 5) -> float:
    """Median µs of ``reps`` eager calls of fn(), each between its own two CUDA events, after one warm call."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def error_ratio(out: torch.Tensor, want: torch.Tensor) -> float:
    return ((out.float() - want).norm() / want.norm()).item()


def measure(run: Callable[[dict], torch.Tensor], cfg: dict, want: torch.Tensor | None, tokens: int) -> dict:
    """One config: µs and its output's error against the defaults' (inf when it fails or is off)."""
    try:
        us, out = time_us(lambda: run(cfg), tokens)
    except Exception as e:  # over the shared memory, or an unsupported launch
        print(f"  {cfg}: {type(e).__name__}: {str(e)[:160]}", flush=True)
        return {"config": cfg, "us": math.inf, "err": None, "ok": False}
    err = 0.0 if want is None else error_ratio(out, want)
    ok = math.isfinite(err) and err <= TOL and bool(torch.isfinite(out).all())
    return {"config": cfg, "us": us if ok else math.inf, "err": err, "ok": ok}


def search(run: Callable[[dict], torch.Tensor], tiles: Tiles, plan: list[tuple[int, list[tuple], list[tuple]]],
           key: str, tokens: int, default: dict, want: torch.Tensor, base: dict, deadline: float,
           min_gain: float) -> dict:
    """Every planned candidate until ``deadline``; the best one other than the defaults (``base`` their row,
    ``want`` their output), and its entry where it wins."""
    rows, best = [base], None
    for bm, ups, downs in plan:
        up_best = None
        for gemm, cands in ((1, ups), (2, downs[1:])):  # downs[0] with the best up: timed among the ups
            for tile in cands:
                if time.time() > deadline:
                    break
                cfg = tiles.config(bm, tile, downs[0]) if gemm == 1 else tiles.config(bm, tiles.of(up_best["config"], 1), tile)
                row = base if cfg == default else measure(run, cfg, want, tokens)
                err = "-" if row["err"] is None else f"{row['err']:.1e}"
                print(f"  T={tokens} {tiles.text(cfg)}: {row['us']:.1f} us, err {err}{'' if row['ok'] else ' REJECTED'}",
                      flush=True)
                if row is not base:
                    rows.append(row)
                    best = row if best is None or row["us"] < best["us"] else best
                if gemm == 1 and (up_best is None or row["us"] < up_best["us"]):
                    up_best = row
            if up_best is None:  # the deadline came first
                break
    result = {"tokens": tokens, "key": key, "default": default, "default_us": base["us"], "best": None,
              "best_us": math.inf, "speedup": 0.0, "best_err": None, "entry": None, "rows": rows,
              "complete": time.time() <= deadline}
    if best is None or not best["ok"]:
        print(f"{key} T={tokens}: no candidate ran correctly in time; no entry", flush=True)
        return result
    again = measure(run, default, want, tokens), measure(run, best["config"], want, tokens)
    default_us, best_us = min(base["us"], again[0]["us"]), min(best["us"], again[1]["us"])  # side by side, again
    entry = best["config"] if best_us < (1 - min_gain) * default_us else None
    print(f"{key} T={tokens}: best {tiles.text(best['config'])} {best_us:.1f} us vs the defaults {default_us:.1f} us "
          f"({default_us / best_us:.3f}x, err {best['err']:.1e}) -> "
          f"{'table entry' if entry else 'no entry (the defaults stay)'}", flush=True)
    return {**result, "default_us": default_us, "best": best["config"], "best_us": best_us,
            "speedup": default_us / best_us, "best_err": best["err"], "entry": entry}


def time_paths(calls: dict[str, tuple[Callable[[], torch.Tensor], torch.Tensor]], tokens: int) -> dict:
    """µs of each named call timed beside the sweep and its error against its own ``want`` (inf where it fails)."""
    context = {}
    for name, (fn, want) in calls.items():
        try:
            us, out = time_us(fn, tokens)
            context[name] = {"us": us, "err": error_ratio(out, want)}
        except Exception as e:  # context only: the sweep goes on
            context[name] = {"us": math.inf, "err": None, "error": f"{type(e).__name__}: {str(e)[:160]}"}
    return context


def pick_variant(result: dict, dequant: dict, min_gain: float) -> dict:
    """The bucket's path: "dequant" where unpacking the experts (``dequant``: ``time_paths``' row) beats the
    fastest grouped launch timed (the defaults or the winner) by more than ``min_gain`` (at least 0), its entry
    then ``{"variant": "dequant"}``; else "grouped", the tile winner's entry (if any) saying so."""
    grouped_us = min(result["default_us"], result["best_us"])
    margin = max(min_gain, 0.0)  # a negative --min-gain (the smoke tests') takes any tile winner, never a slower path
    if dequant["err"] is not None and dequant["err"] <= TOL and dequant["us"] < (1 - margin) * grouped_us:
        print(f"{result['key']} T={result['tokens']}: the dequant path {dequant['us']:.1f} us beats the grouped "
              f"kernel's {grouped_us:.1f} us -> variant dequant", flush=True)
        return {"variant": "dequant", "entry": {"variant": "dequant"}}
    return {"variant": "grouped", "entry": result["entry"] and {"variant": "grouped", **result["entry"]}}


def summary(r: dict, tiles: Tiles) -> str:
    """One result's closing line: the winner, the best grouped candidate against the defaults, the paths beside."""
    best = tiles.text(r["best"]) if r["best"] else "-"
    won = "the dequant path" if r["variant"] == "dequant" else best if r["entry"] else "the defaults"
    paths = "; ".join(f"{name} {row['us']:.1f} us" for name, row in r["context"].items())
    return (f"winner {r['key']} T={r['tokens']}: {won}; best grouped candidate {best} {r['best_us']:.1f} us vs the "
            f"defaults {r['default_us']:.1f} us ({r['speedup']:.3f}x); {paths}")


def sweep_counts(sweep_tokens: Callable[[int, float], dict], token_counts: list[int], deadline: float, out: Path,
                 name: str, kernel: str, info: dict, start: float) -> tuple[list[dict], dict]:
    """``sweep_tokens(tokens, its deadline)`` per token count, the time left shared evenly by those still to
    run; after each, OUT/{name}_sweep.json (everything) and OUT/{name}_table.json ({kernel: entry})."""
    results, entry = [], {}
    for j, tokens in enumerate(token_counts):
        now = time.time()
        results.append(sweep_tokens(tokens, now + max(0.0, deadline - now) / (len(token_counts) - j)))
        entry = {r["key"]: r["entry"] for r in results if r["entry"]}
        (out / f"{name}_sweep.json").write_text(json.dumps(
            {**info, "results": results, "table": {kernel: entry}, "elapsed_s": time.time() - start,
             "deadline_hit": time.time() > deadline}, indent=1, default=str))
        (out / f"{name}_table.json").write_text(json.dumps({kernel: entry}, indent=1))
    return results, entry


def write_table(kernel: str, entry: dict, path: Path, script: str, argv: list[str], device: str) -> None:
    """Merge ``entry`` as ``kernel``'s keys into the table at ``path``: every other kernel and key kept."""
    table = json.loads(path.read_text()) if path.exists() else {}
    comment = (f"bench/{script} on {device}: `python bench/{script} {' '.join(argv)}`; keys e{{E}}_h{{H}}_i{{I}}_"
               "k{slots}_r{rows per expert, up to 2^i}; a key only where > 3% faster than the defaults")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(render(merge(table, {kernel: entry}, comment, by_key=True)))
    os.replace(tmp, path)
    print(f"merged {sorted(entry)} into {path}", flush=True)


def merge_run(table_file: Path, kernel: str, script: str, table_for: Callable[[dict], Path]) -> None:
    """--merge: a GPU run's ``{kernel: entry}`` file into ``table_for(that run's info)``, stamped with the run's
    device and command (read from the ``*_sweep.json`` beside it)."""
    entry = json.loads(table_file.read_text())[kernel]
    run = table_file.with_name(table_file.name.replace("_table.json", "_sweep.json"))
    info = json.loads(run.read_text()) if run.exists() else {}
    if not entry:
        print(f"{table_file}: an empty entry; the table stays as it is")
        return
    write_table(kernel, entry, table_for(info), script, info.get("argv", ["?"]), info.get("device", "unknown GPU"))


def write_winners(entry: dict, kernel: str, script: str, table: Path | None, default_table: Path, out: Path,
                  cpu: bool, argv: list[str], device: str) -> None:
    """--write: the entry into ``table`` (default ``default_table``; interpreter timings go to a copy in ``out``)."""
    if not entry:
        print("--write: no winner beats the defaults by the margin; the table stays as it is")
        return
    path = table or default_table
    if cpu and table is None:  # interpreter timings never reach the package: a copy takes the merge
        path = out / "sm_90.json"
        path.write_text(default_table.read_text())
    write_table(kernel, entry, path, script, argv, device)
