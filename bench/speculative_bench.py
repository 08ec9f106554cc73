"""MTP speculative decoding at the Qwen3.6-35B-A3B shape (random weights, one MTP layer): step costs and tok/s.

Random weights draft garbage, so acceptance is measured twice: with the real verification (the
MTP head's drafts, ~0 accepted) and in the bench-only forced-accept mode (every draft accepted:
the speed a perfect drafter would give, and the cost of a verify step of K + 1 tokens). One engine
with ``--speculative`` serves all speculative rows (force-accept toggled on its runner; "plain
eager" = the same engine with drafting switched off), then the default engine (CUDA graphs)
gives the reference decode speed. Prints a markdown table; JSON to ``$OUT/speculative.json``.

    python bench/speculative_bench.py                 # on the GPU
    python bench/speculative_bench.py --tiny --device cpu
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from qwen_bench import Ours, real_config, sync


def _decode_rate(ours: Ours, batch: int, prompt: int, new: int) -> float:
    return ours.run(batch, prompt, new)["decode_tok_s"]


def _step_time(ours: Ours, prompt: int, steps: int) -> float:
    """Seconds per engine step of one sequence in steady decode."""
    from armillary import SamplingParams

    eng = ours.engine
    ours.ids += 1
    eng.add_request(f"s{ours.ids}", ours._prompt(prompt), SamplingParams(temperature=0.0, max_tokens=2048,
                                                                          ignore_eos=True))
    for _ in range(8):  # prefill and warm-up
        eng.step()
    sync(ours.device)
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    sync(ours.device)
    dt = (time.perf_counter() - t) / steps
    eng.abort_request(f"s{ours.ids}")
    return dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--num-drafts", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new", type=int, default=256)
    args = ap.parse_args()
    cfg = real_config(args.tiny)
    cfg["mtp_num_hidden_layers"] = 1
    k = args.num_drafts
    rows: list[tuple[str, float]] = []

    def add(row: tuple[str, float]) -> None:  # printed as measured: a run cut short keeps its figures
        rows.append(row)
        print(f"| {row[0]} | {row[1]:.3f} |", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        (path / "config.json").write_text(json.dumps(cfg))
        steps = 8 if args.tiny else 64
        new = 16 if args.tiny else args.new
        prompt = 32 if args.tiny else args.prompt

        spec = Ours(path, args.device, 4096, 64, eager=False, speculative=True, num_drafts=k)
        add(("startup with --speculative (s)", spec.startup))
        runner, sched = spec.engine.runner, spec.engine.scheduler
        add((f"b1 decode tok/s, K={k}, real verification (random MTP)", _decode_rate(spec, 1, prompt, new)))
        add(("  acceptance rate (random weights)", spec.engine.stats()["spec_acceptance_rate"]))
        runner.speculative.force_accept = True
        verify_step = _step_time(spec, prompt, steps)
        add((f"verify step, K={k}, forced accept (ms)", verify_step * 1e3))
        add((f"b1 decode tok/s, K={k}, forced accept", _decode_rate(spec, 1, prompt, new)))
        add((f"8 streams tok/s, K={k}, forced accept", _decode_rate(spec, 8, prompt, new)))
        proposer = runner.proposer
        runner.proposer, sched.num_drafts = None, 0  # the same engine, drafting off: eager plain decode
        eager_step = _step_time(spec, prompt, steps)
        add(("plain decode step, eager (ms)", eager_step * 1e3))
        add(("verify step / eager plain step", verify_step / eager_step))
        runner.proposer, sched.num_drafts = proposer, k
        spec.llm.shutdown()  # its weights and caches back before the next engine loads
        del spec, runner, sched, proposer
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()

        plain = Ours(path, args.device, 4096, 64, eager=args.device != "cuda")
        graph_step = _step_time(plain, prompt, steps)
        add(("plain decode step, CUDA graphs (ms)", graph_step * 1e3))
        add(("verify step / graphed plain step", verify_step / graph_step))
        b1 = _decode_rate(plain, 1, prompt, new)
        b8 = _decode_rate(plain, 8, prompt, new)
        add(("b1 decode tok/s, no speculation (graphs)", b1))
        add(("8 streams tok/s, no speculation (graphs)", b8))
        forced_b1 = next(v for name, v in rows if name.startswith(f"b1 decode tok/s, K={k}, forced"))
        forced_b8 = next(v for name, v in rows if name.startswith("8 streams tok/s"))
        add(("forced-accept b1 / no speculation", forced_b1 / b1))
        add(("forced-accept 8 streams / no speculation", forced_b8 / b8))
        # vLLM's reported mean of 2.5 tokens per step at K=2: projected from the measured verify step
        add(("projected b1 tok/s at 2.5 tokens/step", 2.5 / verify_step))
    out = os.environ.get("OUT")
    if out:
        Path(out, "speculative.json").write_text(json.dumps(dict(rows), indent=1))


if __name__ == "__main__":
    main()
