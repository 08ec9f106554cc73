"""Where a batch-1 decode step's time goes at the Qwen3.6-35B-A3B shape (random weights, GPU).

Prints: engine.step() per token; the CUDA-graph replay alone; logits + sampling; batch
preparation; and the top kernels of one eager decode forward (torch.profiler).

    python bench/profile_decode.py --out profile.txt
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from qwen_bench import real_config  # noqa: E402


def timed(fn, n: int) -> float:
    """Mean seconds per call over ``n`` calls (after one warm-up), synchronised."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n


def prefill_profile(eng, n: int, rows: int) -> str:
    """Top kernels of one ``n``-token prefill forward (eager, as the engine runs prefills)."""
    from torch.profiler import ProfilerActivity, profile

    batch, _ = eng.single_sequence_batch(list(range(100, 100 + n)))
    forward_s = timed(lambda: eng.model(batch), 3)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        eng.model(batch)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70)
    return f"prefill forward of {n} tokens: {forward_s * 1e3:.1f} ms ({n / forward_s:.0f} tok/s)\n{table}"


@torch.inference_mode()
def main() -> None:
    from armillary import LLM, SamplingParams

    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--prefill", type=int, default=0, help="also profile one prefill forward of this many tokens")
    ap.add_argument("--rows", type=int, default=40)
    args = ap.parse_args()
    d = Path(tempfile.mkdtemp())
    (d / "config.json").write_text(json.dumps(real_config(False)))
    max_len = max(4096, args.prefill + 64)
    llm = LLM(str(d), load_format="dummy", dtype="bfloat16", max_model_len=max_len, max_num_seqs=8,
              max_num_batched_tokens=max(2048, args.prefill))
    eng = llm.engine
    eng.add_request("p", list(range(100, 1124)), SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
    eng.step()  # prefill
    lines = [f"engine.step(), batch 1, async scheduling {eng.async_scheduling}: {timed(eng.step, 50) * 1e3:.3f} ms"]
    eng.async_scheduling = False
    eng.step()  # reads the step in flight back without launching another
    lines.append(f"engine.step(), batch 1, synchronous: {timed(eng.step, 50) * 1e3:.3f} ms")
    from armillary.step_plan import ScheduledChunk, StepPlan

    seqs = list(eng.scheduler.running)
    for s in seqs:
        eng.cache.allocate(s, len(s))
    plan = StepPlan([ScheduledChunk(s, s.num_computed_tokens, 1, sample=True) for s in seqs])
    sampled = seqs
    batch = eng.runner.prepare(plan)
    graphs = eng.runner.graphs
    lines.append(f"runner.prepare (eager batch): {timed(lambda: eng.runner.prepare(plan), 50) * 1e3:.3f} ms")
    if graphs is not None:
        lines.append(f"graphs.stage (graph inputs): {timed(lambda: graphs.stage(plan), 50) * 1e3:.3f} ms")
    if graphs is not None:
        lines.append(f"graph replay (model forward): {timed(graphs.graphs[1].replay, 50) * 1e3:.3f} ms")
    hidden = eng.model(batch)
    lines.append(f"eager model forward: {timed(lambda: eng.model(batch), 10) * 1e3:.3f} ms")
    logits = eng.model.compute_logits(hidden)
    lines.append(f"compute_logits: {timed(lambda: eng.model.compute_logits(hidden), 50) * 1e3:.3f} ms")
    lines.append(f"sampler: {timed(lambda: eng.runner.sampler(logits, sampled), 50) * 1e3:.3f} ms")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            eng.model(batch)
        torch.cuda.synchronize()
    lines.append(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=70))
    if args.prefill:
        lines.append(prefill_profile(eng, args.prefill, args.rows))
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
