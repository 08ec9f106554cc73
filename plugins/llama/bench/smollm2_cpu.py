"""SmolLM2-135M-Instruct (Q4_1 GGUF) on the CPU: armillary against transformers on the same file.

    python plugins/llama/bench/smollm2_cpu.py [--threads N] [--new-tokens 64]

Measures, in one run:
- ``armillary serve`` with no arguments: wall time from spawning it to its first answered chat
  request over HTTP;
- time to first answer: a fresh ``python`` process that imports the library, loads the GGUF, and
  answers one chat turn greedily (wall time from spawning it to the answer being printed);
- decode tokens/s at batch 1 and batch 8 (greedy, ``--new-tokens`` new tokens, EOS suppressed on both
  sides): (time for N new tokens - time for 1 new token) over (N - 1) x batch tokens.
transformers needs ``accelerate`` to load a GGUF. Prints a table; the machine's load average is shown
because other processes on a small box move these numbers.
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


def serve_to_first_answer() -> tuple[float, str]:
    """Wall time from spawning ``armillary serve`` (no arguments) to its first chat answer over HTTP."""
    import re
    import tempfile

    import httpx

    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen([sys.executable, "-m", "armillary.cli", "serve", "--port", "0"], stdout=log,
                                stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            url = None
            while url is None:
                if proc.poll() is not None or time.perf_counter() - start > 300:
                    log.seek(0)
                    raise RuntimeError(f"armillary serve did not start:\n{log.read()}")
                time.sleep(0.05)
                log.seek(0)
                found = re.search(r"listening on (http://\S+)", log.read())
                url = found.group(1) if found else None
            reply = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
                "model": "SmolLM2-135M-Instruct", "messages": QUESTION, "temperature": 0, "max_tokens": 32}).json()
            return time.perf_counter() - start, reply["choices"][0]["message"]["content"]
        finally:
            proc.terminate()
            proc.wait(30)


def armillary_decode(path, batch_sizes: list[int], new_tokens: int) -> dict[int, float]:
    from armillary import LLM, SamplingParams

    llm = LLM(model=str(path), dtype="float32", max_model_len=2048, max_num_seqs=max(batch_sizes),
              cpu_kv_cache_space_gb=1)
    prompt = llm.get_tokenizer().encode(llm.get_tokenizer().apply_chat_template(PROMPT))
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    rates = {}
    for batch in batch_sizes:
        elapsed = {}
        for n in (1, new_tokens):
            params = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)
            start = time.perf_counter()
            llm.generate([{"prompt_token_ids": prompt}] * batch, params)
            elapsed[n] = time.perf_counter() - start
        rates[batch] = batch * (new_tokens - 1) / (elapsed[new_tokens] - elapsed[1])
    return rates


def transformers_decode(path, batch_sizes: list[int], new_tokens: int) -> dict[int, float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    prompt = tok.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    model.generate(**prompt, max_new_tokens=4, do_sample=False)  # warm-up
    rates = {}
    for batch in batch_sizes:
        inputs = {k: v.repeat(batch, 1) for k, v in prompt.items()}
        elapsed = {}
        for n in (1, new_tokens):
            start = time.perf_counter()
            with torch.no_grad():
                model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               pad_token_id=tok.pad_token_id)
            elapsed[n] = time.perf_counter() - start
        rates[batch] = batch * (new_tokens - 1) / (elapsed[new_tokens] - elapsed[1])
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from armillary_llama.default_model import default_model_path

    path = default_model_path()
    batches = [1, 8]
    served = serve_to_first_answer()
    first = {engine: time_to_first_answer(engine, args.threads) for engine in ("armillary", "transformers")}
    decode = {"armillary": armillary_decode(path, batches, args.new_tokens),
              "transformers": transformers_decode(path, batches, args.new_tokens)}

    print(f"\nSmolLM2-135M-Instruct Q4_1 GGUF, float32, {args.threads} threads, torch {torch.__version__}, "
          f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    print(f"{'engine':<14}{'first answer (s)':>18}{'decode tok/s b=1':>18}{'decode tok/s b=8':>18}")
    for engine in ("armillary", "transformers"):
        print(f"{engine:<14}{first[engine][0]:>18.1f}{decode[engine][1]:>18.1f}{decode[engine][8]:>18.1f}")
    print(f"`armillary serve` (no arguments) to its first answered HTTP request: {served[0]:.1f} s "
          f"({served[1]!r})")
    for engine in ("armillary", "transformers"):
        print(f"{engine} answered: {first[engine][1]}")


if __name__ == "__main__":
    main()
