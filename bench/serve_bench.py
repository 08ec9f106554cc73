"""HTTP serving benchmark, Qwen3.6-35B-A3B shape (random weights): TTFT, tok/s by prompt length, cold start, fcfs vs slai.

Measured through ``armillary serve`` with streamed ``/v1/completions`` (httpx), the way the seeds'
blog measured. Two server starts, each a fresh process:

1. the server's defaults (fcfs), on an empty Triton cache (a temp ``TRITON_CACHE_DIR``): start-up
   time, the first request's TTFT (from its send and from process start; the client first probes
   ``/health`` as a load balancer would, so its own first use of httpx / anyio and the connection,
   ~100 ms, is not counted as the server's), the server's warm-request stage, the first 16K-token
   prompt's TTFT; then TTFT and decode tok/s for short, 1K, 4K and 16K-token prompts (medians);
   then the mixed load below;
2. ``--scheduling-policy slai`` on the now warm Triton cache: start-up time and first TTFT again,
   then the mixed load.

Mixed load: 8 streams decode while 16K-token prompts arrive (each followed by a short prompt);
p50 / p99 / max inter-token latency of the 8 streams while the long prompts are in the system
(against their p50 before), the long prompts' TTFT and the short ones'. One line per figure;
JSON to ``$OUT/serve_bench.json`` (or ``--out``), the servers' logs beside it.

    python bench/serve_bench.py                        # GPU: about 5 minutes on an H200
    python bench/serve_bench.py --tiny --device cpu    # driver smoke test (prompts 32x shorter)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.soak import build_checkpoint  # noqa: E402

MODEL = "serve-bench"
LENGTHS = {"short": 32, "1K": 1024, "4K": 4096, "16K": 16384}
TINY_SCALE = 32  # --tiny: prompt lengths and the long prompts divided by this


@dataclass
class Stream:
    """One streamed completion as the client saw it (perf_counter seconds)."""

    sent: float
    chunks: list[float] = field(default_factory=list)  # arrival of each event carrying text
    completion_tokens: int | None = None

    @property
    def ttft(self) -> float | None:
        return self.chunks[0] - self.sent if self.chunks else None

    @property
    def decode_tok_s(self) -> float | None:
        """Tokens after the first over the time after the first token."""
        n = self.completion_tokens
        if not n or n < 2 or len(self.chunks) < 2 or self.chunks[-1] <= self.chunks[0]:
            return None
        return (n - 1) / (self.chunks[-1] - self.chunks[0])


class Server:
    """``armillary serve`` in a fresh process: spawned, listening, stopped; times from its spawn."""

    def __init__(self, name: str, checkpoint: Path, args: argparse.Namespace, flags: list[str], triton_cache: Path,
                 log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"serve_bench_{name}.log"
        cmd = [sys.executable, "-m", "armillary.cli", "serve", str(checkpoint), "--load-format", "dummy",
               "--port", "0", "--served-model-name", MODEL, "--max-model-len", str(args.max_model_len),
               "--device", args.device, "--dtype", "float32" if args.device == "cpu" else "bfloat16",
               *flags, *args.serve_args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TRITON_CACHE_DIR": str(triton_cache)}
        log_file = open(self.log_path, "w")
        self.spawned = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, cwd=str(ROOT), env=env)
        log_file.close()
        self.url = self._wait_listening(args.start_timeout_s)
        self.startup_s = time.perf_counter() - self.spawned

    def _wait_listening(self, timeout_s: float) -> str:
        deadline = time.perf_counter() + timeout_s
        while time.perf_counter() < deadline:
            found = re.search(r"listening on (http://\S+)", self.log_path.read_text(errors="replace"))
            if found:
                return found.group(1)
            if self.proc.poll() is not None:
                raise SystemExit(f"armillary serve ({self.name}) exited with {self.proc.returncode}:\n"
                                 f"{self.log_path.read_text()[-4000:]}")
            time.sleep(0.05)
        self.proc.kill()
        raise SystemExit(f"armillary serve ({self.name}) did not start in {timeout_s:.0f} s")

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return None


def prompt_ids(n: int, rng: random.Random, usable: list[int]) -> list[int]:
    return [rng.choice(usable) for _ in range(n)]


async def complete(client: httpx.AsyncClient, ids: list[int], max_tokens: int, result: Stream | None = None) -> Stream:
    """A streamed completion of token-id prompt ``ids``, ``max_tokens`` tokens whatever they are, recorded
    into ``result`` as it arrives (so a caller can watch a stream that is still running)."""
    body = {"model": MODEL, "prompt": ids, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0.0, "stream_options": {"include_usage": True}}
    result = result or Stream(0.0)
    result.sent = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"/v1/completions answered {r.status_code}: {(await r.aread())[:500]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"error inside the stream: {line[:500]}")
            if any(c.get("text") for c in event.get("choices") or ()):
                result.chunks.append(time.perf_counter())
            usage = event.get("usage")
            if usage:
                result.completion_tokens = usage.get("completion_tokens")
    return result


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def median(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


class Bench:
    def __init__(self, args: argparse.Namespace, usable: list[int]) -> None:
        self.args = args
        self.usable = usable
        self.rng = random.Random(args.seed)
        self.scale = TINY_SCALE if args.tiny else 1
        self.report: dict = {"tiny": args.tiny, "device": args.device, "figures": {}}
        self.t0 = time.perf_counter()

    def length(self, name: str) -> int:
        return max(8, LENGTHS[name] // self.scale)

    def figure(self, key: str, value, line: str) -> None:
        self.report["figures"][key] = value
        if line:
            print(line, flush=True)

    def out_of_time(self, phase: str) -> bool:
        if time.perf_counter() - self.t0 < self.args.time_limit_s:
            return False
        self.report.setdefault("skipped", []).append(phase)
        print(f"{phase}: skipped, over --time-limit-s {self.args.time_limit_s:.0f}", flush=True)
        return True

    def client(self, url: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(300, connect=30),
                                 limits=httpx.Limits(max_connections=64, max_keepalive_connections=32))

    async def cold_start(self, server: Server, label: str) -> None:
        """The first request of a fresh process (after a readiness probe), then (in it) the first 16K-token prompt."""
        async with self.client(server.url) as client:
            probe_start = time.perf_counter()
            health = await client.get("/health")
            self.figure(f"{label}.health_probe_ms", ms(time.perf_counter() - probe_start),
                        f"{label}: /health {health.status_code} in {ms(time.perf_counter() - probe_start)} ms "
                        f"(the client's own first use included)")
            warm = re.search(r"warm-up: server routes \((\d+) requests in-process\) ([\d.]+) s",
                             server.log_path.read_text(errors="replace"))
            self.figure(f"{label}.server_warm_requests_s", float(warm.group(2)) if warm else None,
                        f"{label}: server warm requests {warm.group(1)} in {warm.group(2)} s" if warm
                        else f"{label}: no server warm-request stage in the log")
            first = await complete(client, prompt_ids(self.length("short"), self.rng, self.usable), 16)
            since_spawn = round(first.chunks[0] - server.spawned, 3) if first.chunks else None
            self.figure(f"{label}.startup_s", round(server.startup_s, 2), f"{label}: start-up {server.startup_s:.1f} s")
            self.figure(f"{label}.first_ttft_ms", ms(first.ttft),
                        f"{label}: first request TTFT {ms(first.ttft)} ms; {since_spawn} s from process start")
            self.figure(f"{label}.first_token_from_spawn_s", since_spawn, "")
            if label == "cold":
                long = await complete(client, prompt_ids(self.length("16K"), self.rng, self.usable), 4)
                self.figure("cold.first_16k_ttft_ms", ms(long.ttft),
                            f"cold: first {self.length('16K')}-token prompt TTFT {ms(long.ttft)} ms")

    async def by_length(self, server: Server) -> None:
        """TTFT and decode tok/s per prompt length with the server's defaults (one warm-up each, medians)."""
        steady_short = None
        async with self.client(server.url) as client:
            for name in LENGTHS:
                n = self.length(name)
                await complete(client, prompt_ids(n, self.rng, self.usable), 8)
                runs = [await complete(client, prompt_ids(n, self.rng, self.usable), self.args.decode_tokens)
                        for _ in range(self.args.repeats)]
                ttft, rate = median([r.ttft for r in runs]), median([r.decode_tok_s for r in runs])
                steady_short = ttft if name == "short" else steady_short
                self.figure(f"defaults.{name}", {"prompt_tokens": n, "ttft_ms": ms(ttft), "decode_tok_s": rate},
                            f"defaults, {name} prompt ({n} tokens): TTFT {ms(ttft)} ms, decode "
                            f"{rate and round(rate, 1)} tok/s (median of {len(runs)})")
        cold = self.report["figures"].get("cold.first_ttft_ms")
        if cold is not None and steady_short:
            ratio = round(cold / (steady_short * 1000), 2)
            self.figure("cold.first_ttft_vs_steady", ratio,
                        f"cold first-request TTFT / steady-state short TTFT: {ratio}x (target <= 1.5x)")

    async def warm_up(self, client: httpx.AsyncClient) -> None:
        """The same requests before each policy's mixed load: every prompt length once, 8 streams briefly."""
        for name in LENGTHS:
            await complete(client, prompt_ids(self.length(name), self.rng, self.usable), 4)
        await asyncio.gather(*(complete(client, prompt_ids(128 // self.scale + 8, self.rng, self.usable), 32)
                               for _ in range(8)))

    async def mixed_load(self, server: Server, policy: str) -> None:
        """8 streams decoding while long prompts arrive, each followed by a short one."""
        a = self.args
        async with self.client(server.url) as client:
            await self.warm_up(client)
            decoding = [Stream(0.0) for _ in range(8)]
            streams = [asyncio.ensure_future(complete(client, prompt_ids(128 // self.scale + 8, self.rng, self.usable),
                                                      a.stream_tokens, s)) for s in decoding]
            while not all(s.chunks for s in decoding) and not any(f.done() for f in streams):
                await asyncio.sleep(0.01)  # every stream decoding
            await asyncio.sleep(a.settle_s)
            window_start = time.perf_counter()
            longs, shorts = [], []
            for _ in range(a.num_long):
                longs.append(asyncio.ensure_future(
                    complete(client, prompt_ids(self.length("16K"), self.rng, self.usable), 8)))
                await asyncio.sleep(0.05)
                shorts.append(asyncio.ensure_future(
                    complete(client, prompt_ids(self.length("short"), self.rng, self.usable), 8)))
                await asyncio.sleep(a.long_gap_s)
            long_done = await asyncio.gather(*longs)
            short_done = await asyncio.gather(*shorts)
            window_end = max((s.chunks[0] for s in long_done + short_done if s.chunks), default=time.perf_counter())
            streams_finished = sum(1 for f in streams if f.done())
            for f in streams:
                f.cancel()  # leaving the streams closes them: the server aborts the rest
            await asyncio.gather(*streams, return_exceptions=True)
        before, during = [], []
        for s in decoding:
            for t0, t1 in zip(s.chunks, s.chunks[1:]):
                if t1 <= window_start:
                    before.append(t1 - t0)
                elif t0 >= window_start and t1 <= window_end:
                    during.append(t1 - t0)
        fig = {"itl_p50_ms": ms(percentile(during, 50)), "itl_p99_ms": ms(percentile(during, 99)),
               "itl_max_ms": ms(max(during) if during else None), "itl_p50_before_ms": ms(percentile(before, 50)),
               "num_gaps": len(during), "long_prompt_tokens": self.length("16K"),
               "long_ttft_ms": [ms(s.ttft) for s in long_done],
               "long_ttft_p50_ms": ms(median([s.ttft for s in long_done])),
               "short_ttft_ms": [ms(s.ttft) for s in short_done],
               "short_ttft_p50_ms": ms(median([s.ttft for s in short_done])),
               "window_s": round(window_end - window_start, 3), "streams_ended_early": streams_finished}
        self.figure(f"mixed.{policy}", fig,
                    f"mixed load, {policy}: inter-token latency p50 {fig['itl_p50_ms']} / p99 {fig['itl_p99_ms']} / "
                    f"max {fig['itl_max_ms']} ms (p50 before the long prompts {fig['itl_p50_before_ms']} ms, "
                    f"{len(during)} gaps); {fig['long_prompt_tokens']}-token prompts' TTFT p50 "
                    f"{fig['long_ttft_p50_ms']} ms {fig['long_ttft_ms']}; short prompts' TTFT p50 "
                    f"{fig['short_ttft_p50_ms']} ms")
        if streams_finished:
            print(f"  warning: {streams_finished} of 8 streams ended inside the window: raise --stream-tokens")


def usable_ids(checkpoint: Path, vocab_size: int) -> list[int]:
    """Prompt ids: every id but the tokenizer's special (added) tokens."""
    added = {t["id"] for t in json.loads((checkpoint / "tokenizer.json").read_text())["added_tokens"]}
    return [i for i in range(vocab_size) if i not in added]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a tiny config of the same shape, prompts 32x shorter")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-model-len", type=int, default=None, help="default: 20480 (1024 with --tiny)")
    ap.add_argument("--repeats", type=int, default=3, help="measured requests per prompt length")
    ap.add_argument("--decode-tokens", type=int, default=None, help="output tokens per measured request "
                                                                   "(default 128, 16 with --tiny)")
    ap.add_argument("--stream-tokens", type=int, default=None,
                    help="mixed load: the 8 streams' max_tokens, more than the window needs (default 4000; 600 tiny)")
    ap.add_argument("--num-long", type=int, default=4, help="mixed load: long prompts arriving")
    ap.add_argument("--long-gap-s", type=float, default=None, help="mixed load: seconds between long prompts "
                                                                   "(default 0.75; 0.3 with --tiny)")
    ap.add_argument("--settle-s", type=float, default=0.5, help="mixed load: decoding time before the first long one")
    ap.add_argument("--tbt-deadline-ms", type=float, default=None, help="slai's deadline (default: the server's)")
    ap.add_argument("--time-limit-s", type=float, default=420.0, help="phases starting later are skipped")
    ap.add_argument("--start-timeout-s", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON file (default: $OUT/serve_bench.json when $OUT is set)")
    ap.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[],
                    help="extra `armillary serve` flags (both starts)")
    args = ap.parse_args()
    tiny = args.tiny
    args.max_model_len = args.max_model_len or (1024 if tiny else 20480)
    args.decode_tokens = args.decode_tokens or (16 if tiny else 128)
    args.stream_tokens = args.stream_tokens or (600 if tiny else 4000)
    args.long_gap_s = args.long_gap_s if args.long_gap_s is not None else (0.3 if tiny else 0.75)

    # a `timeout` still leaves the figures so far and stops the servers (the finally blocks run)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out = args.out or (str(Path(os.environ["OUT"]) / "serve_bench.json") if os.environ.get("OUT") else None)
    work = Path(tempfile.mkdtemp(prefix="armillary_serve_bench_"))
    log_dir = Path(out).parent if out else work
    log_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = work / "checkpoint"
    checkpoint.mkdir()
    cfg = build_checkpoint(checkpoint, tiny)
    triton_cache = work / "triton_cache"  # empty: the first server compiles every kernel it launches
    triton_cache.mkdir()
    bench = Bench(args, usable_ids(checkpoint, cfg["vocab_size"]))
    report = bench.report
    report["args"] = vars(args)
    report["exit_codes"] = exit_codes = {}
    slai_flags = ["--scheduling-policy", "slai"]
    if args.tbt_deadline_ms is not None:
        slai_flags += ["--tbt-deadline-ms", str(args.tbt_deadline_ms)]
    try:
        server = Server("defaults", checkpoint, args, [], triton_cache, log_dir)
        try:
            asyncio.run(bench.cold_start(server, "cold"))
            if not bench.out_of_time("by prompt length"):
                asyncio.run(bench.by_length(server))
            if not bench.out_of_time("mixed load, fcfs"):
                asyncio.run(bench.mixed_load(server, "fcfs"))
        finally:
            exit_codes["defaults"] = server.stop()
        if not bench.out_of_time("slai server"):
            server = Server("slai", checkpoint, args, slai_flags, triton_cache, log_dir)
            try:
                asyncio.run(bench.cold_start(server, "warm_cache_restart"))
                asyncio.run(bench.mixed_load(server, "slai"))
            finally:
                exit_codes["slai"] = server.stop()
        fcfs, slai = report["figures"].get("mixed.fcfs"), report["figures"].get("mixed.slai")
        if fcfs and slai and fcfs["itl_p99_ms"] and slai["itl_p99_ms"] and fcfs["long_ttft_p50_ms"]:
            p99 = round(slai["itl_p99_ms"] / fcfs["itl_p99_ms"], 3)
            ttft = round(slai["long_ttft_p50_ms"] / fcfs["long_ttft_p50_ms"], 3)
            bench.figure("mixed.slai_vs_fcfs", {"itl_p99": p99, "long_ttft_p50": ttft},
                         f"slai / fcfs: p99 inter-token latency {p99}x, long prompts' TTFT {ttft}x")
    finally:
        report["elapsed_s"] = round(time.perf_counter() - bench.t0, 1)
        report["server_logs"] = [str(p) for p in sorted(log_dir.glob("serve_bench_*.log"))]
        print(f"total {report['elapsed_s']} s; server exit codes {exit_codes}", flush=True)
        if out:
            Path(out).write_text(json.dumps(report, indent=1))
            print(f"wrote {out}")
        if log_dir != work:
            shutil.rmtree(work, ignore_errors=True)
    return 0 if all(code == 0 for code in exit_codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
