"""Decode speed with a JSON-schema constraint against the same decode without one, at batch 1 and 32.

    python bench/structured_overhead.py                          # SmolLM2-135M-Instruct (GGUF) on the CPU
    python bench/structured_overhead.py --model DIR --device cuda --dtype bfloat16 --load-format dummy

Both runs decode greedily the same prompts for the same number of new tokens: end-of-sequence is
ignored, and the schema (a list of at least 500 people) cannot be complete within them.
Decode tok/s = (time for N new tokens - time for 1) / ((N - 1) x batch), from the median time of
``--repeats`` runs, plain and constrained runs alternating. For the constrained run, the time
spent per step in the grammar is measured as well: the fill (matchers brought up to date, masks
filled, UTF-8 guard) on the worker thread that overlaps the forward, the mask application and the
matcher advance on the engine thread; and that work against the constrained step's time. On the
CPU the fill competes with the forward for the cores, so that ratio is what the grammar costs; on
a GPU the fill hides behind the forward and the end-to-end figure is what counts. Prints a
markdown table; the load average is shown because other processes on a small box move these numbers.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict

import torch

from armillary import LLM, SamplingParams
from armillary.structured.bitmask import TokenBitmask
from armillary.structured.outputs import StructuredOutputs
from armillary.structured.spec import StructuredSpec

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 24},
    "email": {"type": "string"},
    "tags": {"type": "array", "items": {"enum": ["friend", "family", "work", "other"]}, "maxItems": 3}},
    "required": ["name", "age", "city"]}
SCHEMA = {"type": "object", "properties": {"people": {"type": "array", "items": PERSON, "minItems": 500}},
          "required": ["people"]}
QUESTION = "List the people in my address book as JSON, with name, age, city, email and tags."


class GrammarTimer:
    """Wall time spent in the grammar path of the engine, by part (patched methods, restored on exit)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._saved: list[tuple[type, str, object]] = []

    def __enter__(self) -> GrammarTimer:
        for owner, name, label in ((StructuredOutputs, "fill", "fill"), (TokenBitmask, "apply", "apply"),
                                   (StructuredOutputs, "advance", "advance")):
            original = getattr(owner, name)
            self._saved.append((owner, name, original))
            setattr(owner, name, self._timed(original, label))
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in self._saved:
            setattr(owner, name, original)

    def _timed(self, fn, label: str):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start
                self.calls[label] += 1
        return wrapper


def run_once(llm: LLM, prompt: list[int], batch: int, new_tokens: int, spec: StructuredSpec | None) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, structured=spec)
    sync = torch.cuda.synchronize if llm.engine.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": prompt}] * batch, params)
    sync()
    elapsed = time.perf_counter() - start
    got = {len(o.outputs[0].token_ids) for o in outs}
    assert got == {new_tokens}, f"expected {new_tokens} new tokens per sequence, got {got}"
    return elapsed


def decode_rates(llm: LLM, prompt: list[int], batch: int, new_tokens: int, spec: StructuredSpec,
                 repeats: int) -> tuple[float, float]:
    """(plain, constrained) decode tok/s from median times; the runs alternate (and swap order each round)
    so that drift on a busy box hits both alike."""
    times: dict[tuple[bool, int], list[float]] = defaultdict(list)
    for round_ in range(repeats):
        for constrained in ((False, True) if round_ % 2 == 0 else (True, False)):
            for n in (new_tokens, 1):
                times[constrained, n].append(run_once(llm, prompt, batch, n, spec if constrained else None))
    median = {key: statistics.median(values) for key, values in times.items()}
    return tuple((new_tokens - 1) * batch / (median[c, new_tokens] - median[c, 1]) for c in (False, True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint (default: the llama plugin's SmolLM2 GGUF)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--load-format", default="auto", help="dummy: random weights from config.json alone")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--out", default=None, help="also write the table to this file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model
    if model is None:
        from armillary_llama.default_model import default_model_path

        model = str(default_model_path())
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(model=model, dtype=args.dtype, device=args.device, max_model_len=1024, max_num_seqs=max(batches),
              cpu_kv_cache_space_gb=2, load_format=args.load_format)
    tok = llm.get_tokenizer()
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True))
    spec = StructuredSpec.json_schema(SCHEMA)
    start = time.perf_counter()
    llm.engine.structured.compile(spec)
    compile_s = time.perf_counter() - start
    example = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=40,
                                                                         structured=spec))[0].outputs[0].text
    rows = []
    for batch in batches:
        run_once(llm, prompt, batch, 4, None)  # warm-up
        plain, constrained = decode_rates(llm, prompt, batch, args.new_tokens, spec, args.repeats)
        with GrammarTimer() as timer:
            run_once(llm, prompt, batch, args.new_tokens, spec)
        steps = max(timer.calls["fill"], 1)
        per_step = {k: timer.seconds[k] / steps * 1e3 for k in ("fill", "apply", "advance")}
        parts = " / ".join(f"{v:.2f}" for v in per_step.values())
        share = sum(per_step.values()) / (batch / constrained * 1e3)  # of one constrained decode step
        rows.append(f"| {batch} | {plain:.1f} | {constrained:.1f} | {100 * (1 - constrained / plain):+.1f}% | "
                    f"{parts} | {100 * share:.1f}% |")
    table = "\n".join([
        f"model {model} ({llm.engine.arch.name}, vocab {llm.engine.structured.vocab_size}), device "
        f"{args.device}, dtype {args.dtype}, torch threads {torch.get_num_threads()}, {args.new_tokens} new tokens, "
        f"median of {args.repeats}; load average {os.getloadavg()[0]:.2f}; first compile (tokenizer info + schema) "
        f"{compile_s * 1e3:.0f} ms",
        f"constrained output starts: {example!r}",
        "",
        "| batch | decode tok/s plain | decode tok/s JSON schema | overhead | grammar ms/step: fill / apply / advance "
        "| grammar work / step time |",
        "|---|---|---|---|---|---|",
        *rows,
    ])
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
