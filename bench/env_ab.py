"""A/B of one benchmark command under environment settings, alternated (A B A B ...) on one machine, so drift
between hosts and over time falls on both sides alike; prints each run's figures (``engine.step() X ms``,
``TTFT``, ``tok/s`` lines) under its setting, then the per-setting medians of every ``... N ms`` figure.

    python bench/env_ab.py --env ARMILLARY_L2_PREFETCH=0 --env ARMILLARY_L2_PREFETCH=1 --repeat 2 -- \\
        python bench/profile_step.py --model qwen --fp8 --scenarios decode decode:64 --no-profile

A table decision goes through ``ARMILLARY_TUNING`` (a table as JSON over every tuning table); a setting holding a
comma is given whole with ``--env-json`` (``{"ARMILLARY_TUNING": "{...}"}``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from collections import defaultdict

FIGURE = re.compile(r"^(?P<label>[^:\n]+):.*?(?P<ms>\d+(?:\.\d+)?) ms", re.M)


def settings(pairs: list[str]) -> list[dict[str, str]]:
    """``NAME=VALUE[,NAME=VALUE...]`` per ``--env``: one setting each."""
    out = []
    for pair in pairs:
        out.append(dict(item.split("=", 1) for item in pair.split(",") if item))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE[,NAME=VALUE]: one setting")
    ap.add_argument("--env-json", action="append", default=[], help='one setting as a JSON object {"NAME": "VALUE"}')
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("no command after --")
    runs = settings(args.env) + [json.loads(text) for text in args.env_json]
    if not runs:
        ap.error("no --env / --env-json setting")
    figures: dict[tuple[str, str], list[float]] = defaultdict(list)
    failed = 0
    for r in range(args.repeat):
        for setting in runs:
            tag = ",".join(f"{k}={v}" for k, v in setting.items())
            proc = subprocess.run(command, env={**os.environ, **setting}, capture_output=True, text=True,
                                  timeout=args.timeout)
            print(f"--- run {r + 1}, {tag}: exit {proc.returncode}", flush=True)
            if proc.returncode:
                failed += 1
                print(proc.stdout[-2000:] + proc.stderr[-3000:], flush=True)
                continue
            for m in FIGURE.finditer(proc.stdout):
                figures[(tag, m.group("label").strip())].append(float(m.group("ms")))
                print("   ", m.group(0), flush=True)
    print_medians(figures)
    return 1 if failed else 0


def print_medians(figures: dict[tuple[str, str], list[float]]) -> None:
    """{(setting, figure): ms values} -> one line a figure and setting, grouped by figure."""
    print("medians (ms):")
    for (tag, label), values in sorted(figures.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"  {label:40s} {tag:40s} {statistics.median(values):9.3f}  ({', '.join(f'{v:.3f}' for v in values)})")


if __name__ == "__main__":
    sys.exit(main())
