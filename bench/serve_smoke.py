"""``armillary serve`` as a user runs it (default flags: CUDA graphs, async scheduling) on a llama
checkpoint built here with transformers: start-up to healthy, a chat completion, a streamed one.

    python bench/serve_smoke.py --out $OUT/serve.txt      # on the GPU machine

The checkpoint is a random llama (SmolLM2-135M's shape by default) with the tiny test tokenizer,
since no weights can be downloaded there. Prints one line per check; exits 1 if one fails.
"""
from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fixtures.tiny_tokenizer import make_qwen_tokenizer  # noqa: E402

VOCAB = 512


def build_llama(path: Path, layers: int, hidden: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64,
                      num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=3,
                      max_position_embeddings=2048, tie_word_embeddings=True, torch_dtype="bfloat16")
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    make_qwen_tokenizer(path, vocab_size=VOCAB)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> tuple[int, bytes]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.status, r.read()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=576)
    args = ap.parse_args()
    d = Path(tempfile.mkdtemp())
    build_llama(d, args.layers, args.hidden)
    port = free_port()
    log = open(d / "serve.log", "w")
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "armillary.cli", "serve", str(d), "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    lines, ok = [], True
    base = f"http://127.0.0.1:{port}"
    try:
        while time.time() - t0 < 300:
            if proc.poll() is not None:
                raise RuntimeError(f"armillary serve exited with {proc.returncode}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        lines.append(f"start-up to healthy: {time.time() - t0:.1f} s")
        models = json.loads(urllib.request.urlopen(base + "/v1/models", timeout=10).read())["data"]
        msg = {"model": models[0]["id"], "messages": [{"role": "user", "content": "What is the capital of France?"}],
               "max_tokens": 32, "temperature": 0}
        t = time.time()
        status, raw = post(base + "/v1/chat/completions", msg)
        reply = json.loads(raw)
        text = reply["choices"][0]["message"]["content"]
        usage = reply["usage"]
        good = status == 200 and usage["completion_tokens"] > 0
        ok &= good
        lines.append(f"chat completion: status {status}, {usage['completion_tokens']} tokens in "
                     f"{time.time() - t:.2f} s, finish {reply['choices'][0]['finish_reason']}, text {text[:60]!r}"
                     f" -> {'PASS' if good else 'FAIL'}")
        status, raw = post(base + "/v1/chat/completions", {**msg, "stream": True})
        chunks = [x for x in raw.decode().split("\n\n") if x.startswith("data: ") and x != "data: [DONE]"]
        streamed = "".join(json.loads(c[6:])["choices"][0]["delta"].get("content") or "" for c in chunks
                           if json.loads(c[6:])["choices"])
        good = status == 200 and streamed == text
        ok &= good
        lines.append(f"streamed chat: {len(chunks)} chunks, same text as unstreamed: {streamed == text} "
                     f"-> {'PASS' if good else 'FAIL'}")
        status, raw = post(base + "/v1/completions", {"model": models[0]["id"], "prompt": [1, 2, 3],
                                                     "max_tokens": 64, "temperature": 0, "n": 4})
        good = status == 200 and len(json.loads(raw)["choices"]) == 4
        ok &= good
        lines.append(f"batched completion (n=4, 64 tokens): status {status} -> {'PASS' if good else 'FAIL'}")
    except Exception as exc:  # noqa: BLE001 - report whatever broke, with the server's log
        ok = False
        lines.append(f"FAIL: {type(exc).__name__}: {exc}")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()
    server_log = (d / "serve.log").read_text()
    lines.append("server log (last 40 lines):\n" + "\n".join(server_log.splitlines()[-40:]))
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
