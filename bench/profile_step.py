"""Where an engine step's time goes, per model and scenario (GPU, random weights, default flags).

Scenarios, each timed through ``engine.step()`` as the server runs it (CUDA graphs on) and then
profiled (torch.profiler, CPU + CUDA): ``decode`` (batch-1 steady decode), ``decode:N`` (N streams in steady
decode, 1K prompts), ``verify`` (the K=2 MTP
verify step with every draft accepted; Qwen and GLM only), ``prefill:N`` (one fresh N-token prompt's
first step: its TTFT). Prints the step time, the device time its kernels took (a step much longer
than its kernels waits on the host), the top kernels and the top host ops.

    python bench/profile_step.py --model qwen --scenarios decode verify prefill:64 prefill:2048
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _model(name: str):
    """(config dict, the bench's engine wrapper class) of one model's benchmark driver."""
    if name == "qwen":
        from qwen_bench import Ours, real_config
        return real_config(False), Ours
    if name == "nemotron":
        from nemotron_bench import Ours, nano_config
        return nano_config(False), Ours
    if name == "glm":
        from glm_flash_bench import Ours, real_config
        return real_config(False), Ours
    if name in ("gemma4", "gemma3"):
        from gemma_bench import GEMMA3_27B, GEMMA4_26B_A4B, Ours
        return dict(GEMMA4_26B_A4B if name == "gemma4" else GEMMA3_27B), Ours
    raise SystemExit(f"unknown model {name}")


def _profile(fn, steps: int, rows: int) -> str:
    """Kernel and host tables of ``steps`` calls of ``fn``, with per-call device and wall time."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / steps
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events) / steps
    kernels = sum(e.count for e in events if e.self_device_time_total > 0 and e.device_type.name == "CUDA") / steps
    head = (f"  profiled: {wall * 1e3:.3f} ms wall per call (profiler on), kernels {device_us / 1e3:.3f} ms "
            f"device time, {kernels:.0f} kernel launches per call")
    return "\n".join([head, events.table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=64),
                      events.table(sort_by="self_cpu_time_total", row_limit=rows // 2, max_name_column_width=64)])


def _steady(ours, prompt: int, streams: int = 1) -> list[str]:
    """Adds ``streams`` long requests and runs them into steady decode; returns their ids."""
    from armillary import SamplingParams

    rids = []
    for _ in range(streams):
        ours.ids += 1
        rids.append(f"p{ours.ids}")
        ours.engine.add_request(rids[-1], ours._prompt(prompt), SamplingParams(temperature=0.0, max_tokens=4000,
                                                                               ignore_eos=True))
    for _ in range(8 + streams):  # every prefill done, then steady
        ours.engine.step()
    return rids


def _timed_steps(eng, n: int) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        eng.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n


def steady_steps(ours, label: str, rows: int, streams: int = 1) -> str:
    """``streams`` 1K-prompt requests in steady decode: their timed ``engine.step()`` (64 steps), then 10
    profiled."""
    rids = _steady(ours, 1024, streams)
    ms = _timed_steps(ours.engine, 64) * 1e3
    text = (f"{label}: engine.step() {ms:.3f} ms ({streams / ms * 1e3:.0f} tok/s)\n"
            + _profile(ours.engine.step, 10, rows))
    for rid in rids:
        ours.engine.abort_request(rid)
    ours.engine.step()
    return text


def prefill(ours, n: int, rows: int, profiled: bool = True) -> str:
    """TTFT of a fresh n-token prompt (median of 5 after 2 warm-ups), then (``profiled``) three profiled."""
    from armillary import SamplingParams

    eng = ours.engine

    def first_token() -> float:
        ours.ids += 1
        rid = f"f{ours.ids}"
        torch.cuda.synchronize()
        t = time.perf_counter()
        eng.add_request(rid, ours._prompt(n), SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        while not eng.step():
            pass
        dt = time.perf_counter() - t
        while eng.has_unfinished_requests():
            eng.step()
        return dt

    for _ in range(2):
        first_token()
    ttft = statistics.median(first_token() for _ in range(5))
    head = f"prefill {n}: TTFT {ttft * 1e3:.2f} ms ({n / ttft:.0f} tok/s)\n"
    if not profiled:
        return head
    return head + _profile(first_token, 3, rows) + "\n" + _host(first_token, rows)


def _host(fn, rows: int) -> str:
    """Python functions by own time, then ours by cumulative time, over 3 calls (cProfile): where a host-bound
    step spends it."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(rows)
    stats.sort_stats("cumulative").print_stats("armillary", rows)  # which of our calls carry the launches
    return buf.getvalue()


def verify(ours, rows: int) -> str:
    ours.engine.runner.speculative.force_accept = True
    return steady_steps(ours, "verify K=2 b1 forced accept", rows)


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen")
    ap.add_argument("--scenarios", nargs="+", default=["decode"])
    ap.add_argument("--rows", type=int, default=30)
    ap.add_argument("--fp8", action="store_true", help="weights quantized to 128x128 block fp8 and an fp8 KV cache, "
                    "as fp8_bench.py runs them")
    ap.add_argument("--no-profile", action="store_true", help="timings only (prefill: its TTFT), no profiler tables")
    ap.add_argument("--out")
    args = ap.parse_args()
    cfg, Ours = _model(args.model)
    import armillary.engine
    armillary.engine.warm_up = lambda engine: None  # start-up warm-up only costs device time here: scenarios warm themselves
    spec = "verify" in args.scenarios
    if spec:
        cfg["mtp_num_hidden_layers" if args.model == "qwen" else "num_nextn_predict_layers"] = 1
    d = Path(tempfile.mkdtemp())
    (d / "config.json").write_text(json.dumps(cfg))
    extra = {"speculative": True, "num_drafts": 2} if spec else {}
    if args.fp8:
        extra.update(quantization="fp8_block", kv_cache_dtype="fp8")
    streams = max([8] + [int(sc.split(":")[1]) for sc in args.scenarios if sc.startswith("decode:")])
    ours = Ours(d, "cuda", 20480, streams, eager=False, **extra)
    lines = [f"{args.model}: start-up {ours.startup:.1f} s"]
    for sc in args.scenarios:
        if sc == "decode" and not spec:
            lines.append(steady_steps(ours, "decode b1", args.rows))
        elif sc.startswith("decode:"):
            n = int(sc.split(":")[1])
            lines.append(steady_steps(ours, f"decode {n} streams", args.rows, n))
        elif sc == "verify":
            lines.append(verify(ours, args.rows))
        elif sc.startswith("prefill:"):
            lines.append(prefill(ours, int(sc.split(":")[1]), args.rows, not args.no_profile))
        print(lines[-1], flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
