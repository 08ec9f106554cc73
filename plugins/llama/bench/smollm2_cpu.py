"""SmolLM2-135M-Instruct (Q4_1 GGUF) on the CPU: armillary against transformers on the same file.

    python plugins/llama/bench/smollm2_cpu.py [--threads N] [--new-tokens 64] [--prompt-tokens 2039] [--repeats 3]

Measures, in one run:
- ``armillary serve`` with no arguments: wall time from spawning it to ``GET /health`` answering 200,
  and to its first answered chat request over HTTP;
- time to first answer: a fresh ``python`` process that imports the library, loads the GGUF, and
  answers one chat turn greedily (wall time from spawning it to the answer being printed);
- prefill: one ``--prompt-tokens`` prompt to its first generated token;
- decode tokens/s at batch 1 and batch 8 (greedy, ``--new-tokens`` new tokens, EOS suppressed on both
  sides): (time for N new tokens - time for 1 new token) over (N - 1) x batch tokens.
Both engines live in this process and take turns, each measurement repeated ``--repeats`` times (the
best is shown), so a shared machine's load hits both alike; the ratio column is armillary's time
over transformers' (below 1: armillary is faster). transformers needs ``accelerate`` to load a GGUF.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]
LONG_TEXT = ("The robot stood before the canvas, brush in hand, and considered the colours of the morning sky. "
             "Every day it had watched the light change over the harbour, recording wavelengths and angles. ")

_FIRST_ANSWER = {
    "armillary": """
from armillary import LLM, SamplingParams
from armillary_llama.default_model import default_model_path
llm = LLM(model=str(default_model_path()), dtype="float32", max_model_len=2048, max_num_seqs=8, cpu_kv_cache_space_gb=1)
out = llm.chat({question!r}, SamplingParams(temperature=0.0, max_tokens=32))
print(repr(out[0].outputs[0].text))
""",
    "transformers": """
from transformers import AutoModelForCausalLM, AutoTokenizer
from armillary_llama.default_model import default_model_path
path = default_model_path()
tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype="float32")
ids = tok.apply_chat_template({question!r}, add_generation_prompt=True, return_tensors="pt", return_dict=True)
out = model.generate(**ids, max_new_tokens=32, do_sample=False)
print(repr(tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)))
""",
}


def time_to_first_answer(engine: str, threads: int) -> tuple[float, str]:
    code = f"import torch; torch.set_num_threads({threads})\n" + _FIRST_ANSWER[engine].format(question=QUESTION)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return time.perf_counter() - start, done.stdout.strip().splitlines()[-1]


def serve_start_up() -> tuple[float, float, str]:
    """(seconds to a 200 from /health, seconds to the first chat answer, that answer) for ``armillary serve``."""
    import re
    import tempfile

    import httpx

    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen([sys.executable, "-m", "armillary.cli", "serve", "--port", "0"], stdout=log,
                                stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            url, healthy = None, None
            while healthy is None:
                if proc.poll() is not None or time.perf_counter() - start > 300:
                    log.seek(0)
                    raise RuntimeError(f"armillary serve did not become healthy:\n{log.read()}")
                time.sleep(0.02)
                if url is None:
                    log.seek(0)
                    found = re.search(r"listening on (http://\S+)", log.read())
                    url = found.group(1) if found else None
                    continue
                try:
                    if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                        healthy = time.perf_counter() - start
                except httpx.HTTPError:
                    pass
            reply = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
                "model": "SmolLM2-135M-Instruct", "messages": QUESTION, "temperature": 0, "max_tokens": 32}).json()
            return healthy, time.perf_counter() - start, reply["choices"][0]["message"]["content"]
        finally:
            proc.terminate()
            proc.wait(30)


class Armillary:
    name = "armillary"

    def __init__(self, path, max_batch: int) -> None:
        from armillary import LLM

        self.llm = LLM(model=str(path), dtype="float32", max_model_len=2048, max_num_seqs=max_batch,
                       cpu_kv_cache_space_gb=1)

    def run(self, prompt: list[int], batch: int, new_tokens: int) -> float:
        from armillary import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens)
        start = time.perf_counter()
        self.llm.generate([{"prompt_token_ids": prompt}] * batch, params)
        return time.perf_counter() - start


class Transformers:
    name = "transformers"

    def __init__(self, path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        self.model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                          dtype=torch.float32).eval()

    def run(self, prompt: list[int], batch: int, new_tokens: int) -> float:
        ids = torch.tensor([prompt] * batch)
        start = time.perf_counter()
        with torch.no_grad():
            self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, do_sample=False, pad_token_id=self.tok.pad_token_id)
        return time.perf_counter() - start


def measure(engines, chat_prompt: list[int], long_prompt: list[int], new_tokens: int, repeats: int) -> dict:
    """Per engine: best prefill seconds and decode tokens/s at batch 1 and 8, the engines taking turns."""
    best: dict[str, dict[str, float]] = {e.name: {} for e in engines}

    def keep(engine, key: str, value: float, lower_is_better: bool) -> None:
        old = best[engine.name].get(key)
        if old is None or (value < old if lower_is_better else value > old):
            best[engine.name][key] = value

    for engine in engines:
        engine.run(chat_prompt, 1, 4)  # warm-up
        engine.run(long_prompt[:256], 1, 1)
    for _ in range(repeats):
        for engine in engines:
            keep(engine, "prefill", engine.run(long_prompt, 1, 1), True)
        for batch in (1, 8):
            for engine in engines:
                one = engine.run(chat_prompt, batch, 1)
                many = engine.run(chat_prompt, batch, new_tokens)
                keep(engine, f"decode{batch}", batch * (new_tokens - 1) / (many - one), False)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=2039)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from armillary_llama.default_model import default_model_path

    load_before = os.getloadavg()
    path = default_model_path()
    healthy, served, served_answer = serve_start_up()
    first = {engine: time_to_first_answer(engine, args.threads) for engine in ("armillary", "transformers")}
    engines = [Armillary(path, 8), Transformers(path)]
    tok = engines[0].llm.get_tokenizer()
    chat_prompt = tok.encode(tok.apply_chat_template(PROMPT))
    long_prompt = tok.encode(LONG_TEXT * (args.prompt_tokens // 30 + 1))[: args.prompt_tokens]
    best = measure(engines, chat_prompt, long_prompt, args.new_tokens, args.repeats)
    load_after = os.getloadavg()

    print(f"\nSmolLM2-135M-Instruct Q4_1 GGUF, float32, {args.threads} threads, torch {torch.__version__}, "
          f"{os.cpu_count()} cores; load average (1/5/15 min) before {load_before[0]:.2f}/{load_before[1]:.2f}/"
          f"{load_before[2]:.2f}, after {load_after[0]:.2f}/{load_after[1]:.2f}/{load_after[2]:.2f}")
    print(f"{'engine':<14}{'first answer (s)':>18}{f'prefill {len(long_prompt)} (s)':>18}"
          f"{'decode tok/s b=1':>18}{'decode tok/s b=8':>18}")
    rows = {"armillary": best["armillary"], "transformers": best["transformers"]}
    for name, row in rows.items():
        print(f"{name:<14}{first[name][0]:>18.2f}{row['prefill']:>18.2f}{row['decode1']:>18.1f}"
              f"{row['decode8']:>18.1f}")
    a, t = rows["armillary"], rows["transformers"]
    print(f"{'time ratio':<14}{first['armillary'][0] / first['transformers'][0]:>18.2f}"
          f"{a['prefill'] / t['prefill']:>18.2f}{t['decode1'] / a['decode1']:>18.2f}{t['decode8'] / a['decode8']:>18.2f}")
    print(f"`armillary serve` (no arguments): healthy after {healthy:.2f} s, first answered HTTP chat request after "
          f"{served:.2f} s ({served_answer!r})")
    for engine in ("armillary", "transformers"):
        print(f"{engine} answered: {first[engine][1]}")


if __name__ == "__main__":
    main()
