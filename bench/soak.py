"""Soak: ``armillary serve`` of the Qwen3.6-35B-A3B shape (random weights) under N concurrent streaming clients for minutes.

Clients stream chat completions, completions, messages and responses of mixed prompt and output
lengths; 10% drop their stream midway, 5% send a bad request. Reports the 5xx count, what the
engine still holds at the end (KV blocks, state slots, snapshots, from /metrics), device memory
in the first vs the last minute, and output tokens per minute. One line per figure; JSON to
``$OUT/soak.json`` (or ``--out``); exits 1 when a criterion fails.

    python bench/soak.py                                # GPU: 64 clients, 10 minutes
    python bench/soak.py --minutes 2 --clients 32
    python bench/soak.py --tiny --device cpu --minutes 0.3 --clients 4 --max-model-len 1024   # driver smoke test
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.qwen_bench import real_config  # noqa: E402
from tests.fixtures.tiny_tokenizer import make_qwen_tokenizer  # noqa: E402

MODEL = "soak"
PROMPT_WORDS = (8, 64, 256, 900)  # words of filler text (about 6 tokens each): mixed prompt lengths
TOKENS_PER_WORD = 7  # an upper bound, to keep prompt + output within --max-model-len
OUTPUT_TOKENS = (16, 64, 256, 768)
DROP_RATE, BAD_RATE = 0.10, 0.05


def widen_vocab(path: Path, vocab_size: int) -> None:
    """Give every model id a token (``" w<id>"``): random weights sample the whole vocabulary, and ids the tiny
    tokenizer lacks would decode to nothing, so streams would carry no text."""
    tok_file = path / "tokenizer.json"
    data = json.loads(tok_file.read_text())
    vocab = data["model"]["vocab"]
    used = set(vocab.values()) | {t["id"] for t in data["added_tokens"]}
    for i in range(vocab_size):
        if i not in used:
            vocab[f"\u0120w{i}"] = i  # byte-level: U+0120 is the space byte
    tok_file.write_text(json.dumps(data))


def build_checkpoint(path: Path, tiny: bool) -> dict:
    cfg = real_config(tiny)
    (path / "config.json").write_text(json.dumps(cfg))
    make_qwen_tokenizer(path, vocab_size=cfg["vocab_size"])
    widen_vocab(path, cfg["vocab_size"])
    return cfg


def start_server(path: Path, args: argparse.Namespace, log_path: Path) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "armillary.cli", "serve", str(path), "--load-format", "dummy", "--port", "0",
           "--served-model-name", MODEL, "--max-model-len", str(args.max_model_len),
           "--max-num-seqs", str(args.clients), "--device", args.device,
           "--dtype", "float32" if args.device == "cpu" else "bfloat16", *args.serve_args]
    log_file = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, cwd=str(ROOT),
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    log_file.close()
    deadline = time.monotonic() + 1800
    while time.monotonic() < deadline:
        found = re.search(r"listening on (http://\S+)", log_path.read_text(errors="replace"))
        if found:
            return proc, found.group(1)
        if proc.poll() is not None:
            raise SystemExit(f"armillary serve exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("armillary serve did not start in 30 minutes")


class DeviceMemory:
    """``nvidia-smi``'s used memory of GPU 0 every few seconds (no CUDA context in this process)."""

    def __init__(self, interval_s: float = 5.0) -> None:
        self.samples: list[tuple[float, float]] = []  # (seconds since start, MiB)
        self._stop = threading.Event()
        self._interval = interval_s
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                      "-i", "0"], capture_output=True, text=True, timeout=10).stdout
                self.samples.append((time.monotonic() - self._t0, float(out.strip().splitlines()[0])))
            except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
                return  # no GPU here: memory is not reported
            self._stop.wait(self._interval)

    def window_mean(self, start: float, end: float) -> float | None:
        values = [mib for t, mib in self.samples if start <= t < end]
        return sum(values) / len(values) if values else None


@dataclass
class Tally:
    by_minute: dict[int, dict[str, int]] = field(default_factory=dict)
    statuses: dict[int, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)  # 5xx bodies, errors inside streams, transport errors

    def add(self, minute: int, key: str, value: int = 1) -> None:
        row = self.by_minute.setdefault(minute, {})
        row[key] = row.get(key, 0) + value


def words(n: int, rng: random.Random) -> str:
    return " ".join(f"w{rng.randrange(1000, 100000)}" for _ in range(n))


def good_request(rng: random.Random, max_words: int, scale: int, stream: bool = True) -> tuple[str, dict]:
    text = words(max(1, min(rng.choice(PROMPT_WORDS) // scale, max_words)), rng)
    n = max(2, rng.choice(OUTPUT_TOKENS) // scale)
    kind = rng.choice(("chat", "completions", "messages", "responses"))
    common = {"model": MODEL, "stream": stream, "ignore_eos": True, "temperature": 0.8}
    if kind == "chat":
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": text}], "max_tokens": n,
                                        "stream_options": {"include_usage": True}}
    if kind == "completions":
        return "/v1/completions", {**common, "prompt": text, "max_tokens": n,
                                   "stream_options": {"include_usage": True}}
    if kind == "messages":
        return "/v1/messages", {**common, "messages": [{"role": "user", "content": text}], "max_tokens": n}
    return "/v1/responses", {**common, "input": text, "max_output_tokens": n}


BAD_REQUESTS: tuple[tuple[str, object], ...] = (
    ("/v1/chat/completions", "{not json"),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [], "max_tokens": 4}),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -1}),
    ("/v1/completions", {"model": MODEL, "prompt": [10**9], "max_tokens": 4}),
    ("/v1/messages", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}),
    ("/v1/responses", {"model": MODEL, "input": "x", "tool_choice": {"type": "function", "name": "none"}}),
    ("/v1/responses", {"model": MODEL, "input": "x", "previous_response_id": "resp_missing"}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 10**6}),
)


def output_tokens(event: dict) -> int | None:
    usage = event.get("usage") or (event.get("response") or {}).get("usage")
    if not isinstance(usage, dict):
        return None
    return usage.get("completion_tokens", usage.get("output_tokens"))


async def one_request(client: httpx.AsyncClient, rng: random.Random, tally: Tally, minute: int,
                      max_words: int, scale: int) -> None:
    roll = rng.random()
    if roll < BAD_RATE:
        path, body = rng.choice(BAD_REQUESTS)
        kwargs = {"content": body} if isinstance(body, str) else {"json": body}
        r = await client.post(path, headers={"content-type": "application/json"}, **kwargs)
        tally.statuses[r.status_code] = tally.statuses.get(r.status_code, 0) + 1
        tally.add(minute, "bad_requests")
        if r.status_code >= 500 or r.status_code < 400:
            tally.failures.append(f"bad request {path} got {r.status_code}: {r.text[:300]}")
        return
    drop_after = rng.randrange(1, 40) if roll < BAD_RATE + DROP_RATE else None
    path, body = good_request(rng, max_words, scale)
    async with client.stream("POST", path, json=body) as r:
        tally.statuses[r.status_code] = tally.statuses.get(r.status_code, 0) + 1
        if r.status_code != 200:
            text = (await r.aread()).decode(errors="replace")
            tally.failures.append(f"a good {path} request got {r.status_code}: {text[:300]}")
            return
        events = 0
        produced = None
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event and event.get("type") in (None, "error") or event.get("type") == "response.failed":
                tally.failures.append(f"error inside a {path} stream: {line[:300]}")
            produced = output_tokens(event) or produced
            events += 1
            if drop_after is not None and events >= drop_after:
                tally.add(minute, "dropped")
                return  # leaving the block closes the connection mid-stream
    tally.add(minute, "completed")
    tally.add(minute, "output_tokens", produced or 0)


def progress_path(args: argparse.Namespace) -> Path | None:
    out = args.out or (str(Path(os.environ["OUT"]) / "soak.json") if os.environ.get("OUT") else None)
    return Path(out).with_suffix(".progress.json") if out else None


async def write_progress(path: Path | None, tally: Tally, t0: float) -> None:
    """Every 30 s, what the clients saw so far: a run cut short by a time limit still leaves its figures."""
    while path is not None:
        await asyncio.sleep(30)
        path.write_text(json.dumps({"elapsed_s": time.monotonic() - t0, "per_minute": tally.by_minute,
                                    "statuses": tally.statuses, "failures": tally.failures[:50]}, indent=1))


async def drive(url: str, args: argparse.Namespace, tally: Tally, t0: float) -> None:
    end = t0 + args.minutes * 60
    max_words = max(1, (args.max_model_len - max(OUTPUT_TOKENS) - 64) // TOKENS_PER_WORD)
    limits = httpx.Limits(max_connections=args.clients + 8, max_keepalive_connections=args.clients)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600, connect=30), limits=limits) as client:
        async def worker(k: int) -> None:
            rng = random.Random(args.seed * 1000 + k)
            while time.monotonic() < end:
                minute = int((time.monotonic() - t0) // 60)
                try:
                    await one_request(client, rng, tally, minute, max_words, 8 if args.tiny else 1)
                except httpx.HTTPError as exc:
                    tally.failures.append(f"transport error: {exc!r}")

        progress = asyncio.ensure_future(write_progress(progress_path(args), tally, t0))
        try:
            await asyncio.gather(*(worker(k) for k in range(args.clients)))
        finally:
            progress.cancel()


def held(url: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("armillary_") and " " in line:
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    get = lambda k: values.get(f"armillary_{k}", 0.0)  # noqa: E731
    return {"kv_blocks_used": get("kv_blocks_used"),
            "state_slots_used": get("state_slots_used"), "state_slots_held": get("state_slots_held"),
            "state_snapshots_leaked": get("state_snapshots_used") - get("state_snapshots_cached"),
            "requests_running": get("num_requests_running"), "requests_waiting": get("num_requests_waiting")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--tiny", action="store_true",
                    help="a tiny config of the same shape, prompts and outputs 8x shorter (driver smoke test)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON file (default: $OUT/soak.json when $OUT is set)")
    ap.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[], help="extra `armillary serve` flags")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="armillary_soak_"))
    build_checkpoint(work, args.tiny)
    log_path = work / "serve.log"
    proc, url = start_server(work, args, log_path)
    print(f"serving at {url} (log {log_path})", flush=True)
    memory = DeviceMemory()
    tally = Tally()
    try:
        memory.start()
        t0 = time.monotonic()
        asyncio.run(drive(url, args, tally, t0))
        elapsed = time.monotonic() - t0
        idle_deadline = time.monotonic() + 60
        leftover = held(url)
        while any(leftover.values()) and time.monotonic() < idle_deadline:
            time.sleep(0.5)
            leftover = held(url)
        serving = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "w1 w2", "max_tokens": 2},
                             timeout=120).status_code == 200
    finally:
        memory.stop()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        exit_code = proc.wait(60)
    minutes = sorted(tally.by_minute)
    per_minute = [tally.by_minute[m].get("output_tokens", 0) for m in minutes]
    last = max(0.0, elapsed - 60)
    mem_first, mem_last = memory.window_mean(0, 60), memory.window_mean(last, elapsed + 1)
    num_5xx = sum(n for s, n in tally.statuses.items() if s >= 500)
    report = {
        "minutes": args.minutes, "clients": args.clients, "tiny": args.tiny, "elapsed_s": elapsed,
        "statuses": {str(k): v for k, v in sorted(tally.statuses.items())}, "num_5xx": num_5xx,
        "failures": tally.failures[:50], "num_failures": len(tally.failures), "held_at_end": leftover,
        "serving_afterwards": serving, "server_exit_code": exit_code,
        "device_memory_mib_first_minute": mem_first, "device_memory_mib_last_minute": mem_last,
        "output_tokens_per_minute": per_minute, "per_minute": [tally.by_minute[m] for m in minutes],
    }
    steady = len(per_minute) < 3 or min(per_minute[:-1]) >= 0.8 * max(per_minute[:-1])  # the last minute is partial
    flat = mem_first is None or mem_last is None or mem_last <= mem_first * 1.02 + 64
    report["ok"] = ok = (num_5xx == 0 and not tally.failures and not any(leftover.values()) and serving
                         and exit_code == 0 and flat)
    report["throughput_steady"] = steady
    print(f"5xx responses: {num_5xx}; failures: {len(tally.failures)}; statuses {report['statuses']}")
    print(f"held at the end: {leftover}")
    print(f"device memory MiB, first minute {mem_first} vs last minute {mem_last} (flat: {flat})")
    print(f"output tokens per minute: {per_minute} (steady within 20%: {steady})")
    print(f"requests per minute: {report['per_minute']}")
    print(f"serving afterwards: {serving}; server exit code {exit_code}; ok: {ok}")
    for line in tally.failures[:5]:
        print("  failure:", line)
    out = args.out or (str(Path(os.environ["OUT"]) / "soak.json") if os.environ.get("OUT") else None)
    if out:
        Path(out).write_text(json.dumps(report, indent=1))
        print(f"wrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
