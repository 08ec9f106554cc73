"""Cold and warm starts at the Qwen3.6-35B-A3B shape: start-up time and the first requests' TTFT against steady state.

Each start is a fresh child process (nothing compiled in memory), random weights
(``load_format="dummy"``), the engine's defaults otherwise:
- ``cold``: an empty ``TRITON_CACHE_DIR``, warm-up on: start-up seconds (the engine logs one line
  per warm-up stage), then the TTFT of a first short prompt and a first 16K prompt, then the same
  shapes again (steady state, median of 3): the issue's bound is first <= 1.5x steady;
- ``warm cache``: the same folder again, so Triton's cache is reused: start-up seconds and TTFTs;
- ``no warm-up`` (with ``--baseline``): another empty folder, warm-up off: what a first request
  paid before.
One line per figure; JSON to ``$OUT/warm_start.json``.

    python bench/warm_start.py                       # on the GPU (two starts; --baseline adds a third)
    python bench/warm_start.py --tiny --device cpu   # smoke test of the driver itself
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def ttft(engine, prompt: list[int], rid: str) -> float:
    from armillary import SamplingParams

    start = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def child(args) -> None:
    import torch

    from armillary import LLM
    from qwen_bench import real_config

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    with tempfile.TemporaryDirectory() as d:
        Path(d, "config.json").write_text(json.dumps(real_config(args.tiny)))
        long_len = 16384 // (32 if args.tiny else 1)
        start = time.perf_counter()
        llm = LLM(d, load_format="dummy", dtype="float32" if args.tiny else "bfloat16", device=args.device,
                  max_model_len=long_len + 1024, warmup=args.warmup == 1)
        startup = time.perf_counter() - start
        engine = llm.engine
        vocab = min(engine.hf_config.vocab_size, 150000)
        g = torch.Generator().manual_seed(0)

        def prompt(n: int) -> list[int]:
            return torch.randint(0, vocab, (n,), generator=g).tolist()

        first_short = ttft(engine, prompt(64), "first-short")
        first_long = ttft(engine, prompt(long_len), "first-long")
        steady_short = statistics.median(ttft(engine, prompt(64), f"s{i}") for i in range(3))
        steady_long = statistics.median(ttft(engine, prompt(long_len), f"l{i}") for i in range(3))
        print(json.dumps({"startup_s": startup, "engine_startup_s": engine.stats()["startup_seconds"],
                          "first_short_s": first_short, "first_long_s": first_long, "steady_short_s": steady_short,
                          "steady_long_s": steady_long, "long_tokens": long_len,
                          "budget": engine.config.max_num_batched_tokens}), flush=True)


def run_child(label: str, cache: Path, warmup: bool, args, results: dict) -> None:
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache)}
    cmd = [sys.executable, __file__, "--child", "--warmup", str(int(warmup)), "--device", args.device]
    cmd += ["--tiny"] if args.tiny else []
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.child_timeout_s)
    wall = time.perf_counter() - start
    stages = [line for line in proc.stderr.splitlines() if line.startswith(("warm-up:", "start-up:", "weights:"))]
    if proc.returncode != 0:
        print(f"{label}: child failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}", flush=True)
        results[label] = {"error": proc.stderr[-4000:]}
        return
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    r["process_wall_s"], r["log"] = wall, stages
    results[label] = r
    print(f"{label}: start-up {r['startup_s']:.1f} s (process {wall:.1f} s, budget {r['budget']} tokens); "
          f"first short TTFT {r['first_short_s'] * 1e3:.0f} ms vs steady {r['steady_short_s'] * 1e3:.0f} ms "
          f"({r['first_short_s'] / r['steady_short_s']:.2f}x); first {r['long_tokens']}-token TTFT "
          f"{r['first_long_s'] * 1e3:.0f} ms vs steady {r['steady_long_s'] * 1e3:.0f} ms "
          f"({r['first_long_s'] / r['steady_long_s']:.2f}x)", flush=True)
    for line in stages if args.verbose else [s for s in stages if s.startswith(("start-up", "warm-up: ") )][-3:]:
        print(f"  {line}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--baseline", action="store_true", help="a third start: empty cache, warm-up off")
    ap.add_argument("--verbose", action="store_true", help="print every warm-up stage line")
    ap.add_argument("--child-timeout-s", type=float, default=280.0)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--warmup", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    results: dict = {}
    with tempfile.TemporaryDirectory() as root:
        cache = Path(root, "triton-cache")
        run_child("cold", cache, True, args, results)
        run_child("warm cache", cache, True, args, results)
        if args.baseline:
            run_child("no warm-up", Path(root, "triton-cache-baseline"), False, args, results)
    out = os.environ.get("OUT")
    if out:
        Path(out, "warm_start.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
