"""Sweep the paged-attention decode launch (tiles, warps, key splits) at one model's attention shapes, in CUDA graphs.

    python bench/attention_decode_sweep.py --out DIR --model gemma4   # GPU: DIR/attention_decode_sweep.json
    python bench/attention_decode_sweep.py --out DIR --model qwen --smoke   # CPU interpreter: the plumbing only
    python bench/attention_decode_sweep.py --out DIR --model qwen --kv fp8  # an fp8 (e4m3) KV cache, as FP8 serves

Decode attention runs inside the decode CUDA graphs with ``max_seq_len`` = the graph's bound (the whole
context limit), so the number of key splits is fixed by that bound and by ``split_min_tokens`` /
``target_waves``, not by the live length: a sliding layer of 8 kv heads at batch 1 gets 4 splits = 32
programs on a 132-SM GPU. The ``paged_attention_decode`` table is keyed by padded head dim (``d256``);
a plugin's table lies over core's, so a model's entries do not move another model's. Per head-dim key
of the model this times the defaults and every candidate at batch 1 (1K and 4K context), 8 and 64
(1K), each replayed in a CUDA graph captured with the bound, and keeps the candidate with the lowest
geometric mean of time ratios to the defaults when that mean is under 0.97 and no case is slower than
1.03x. Every timed config's output is checked against the defaults' (same math, other split points).
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))

from armillary.kernels import tuning  # noqa: E402
from armillary.kernels.triton import paged_attention as pa  # noqa: E402
from decode_shapes import MODELS, PACKAGES, hf_config  # noqa: E402

DEVICE = "cpu" if SMOKE else "cuda"
DTYPE = torch.float32 if SMOKE else torch.bfloat16
PAGE = 16
WIN, WORST = 0.97, 1.03
CASES = [(1, 1024), (1, 4096), (8, 1024), (64, 1024)]  # (batch, live context)
CANDIDATES = [dict(BLOCK_N=n, num_warps=w, num_stages=2, split_min_tokens=s, target_waves=t)
              for n, w, s, t in itertools.product((16, 32, 64), (4, 8), (32, 64, 128, 256), (1, 2, 4))]
BOUND = 16896  # the benches' context limit (16K prompt + 512): the graphs' max_seq_len
if SMOKE:
    CASES, BOUND = [(1, 40), (3, 20)], 64
    CANDIDATES = [dict(BLOCK_N=16, num_warps=2, num_stages=1, split_min_tokens=s, target_waves=1) for s in (16, 32)]


@dataclass(frozen=True, slots=True)
class AttentionShape:
    key: str  # the table's shape key, d{padded head dim}
    heads: int
    kv_heads: int
    head_dim: int
    window: int | None


def model_shapes(model: str) -> list[AttentionShape]:
    """The decode attention shapes of ``model``, one per table key: the first layer's of that key (Gemma's first
    layers are its most common kind, the sliding ones)."""
    if SMOKE:
        return [AttentionShape("d64", 4, 2, 24, 16)]
    cfg = hf_config(model)
    if model == "qwen":
        found = [(cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], None)]
    elif model in ("gemma4", "gemma3"):
        from gemma_bench import _layer_shapes

        found = [(cfg["num_attention_heads"], hkv, d, cfg["sliding_window"] if kind == "sliding_attention" else None)
                 for kind, hkv, d in _layer_shapes(cfg)]
    else:
        raise SystemExit(f"attention_decode_sweep: {model} decodes through its own attention kernel; nothing to sweep")
    shapes: dict[str, AttentionShape] = {}
    for hq, hkv, d, window in found:
        shapes.setdefault(pa._shape_key(d), AttentionShape(pa._shape_key(d), hq, hkv, d, window))
    return list(shapes.values())


KV_FP8 = False  # --kv fp8: caches stored as e4m3 with fp32 scales


class Case:
    """One (batch, context) decode over a shuffled paged cache, captured into a CUDA graph per config."""

    def __init__(self, shape: AttentionShape, batch: int, context: int, seed: int = 0) -> None:
        g = torch.Generator(device=DEVICE).manual_seed(seed)
        blocks = batch * math.ceil(BOUND / PAGE) + 1
        cache = (blocks, PAGE, shape.kv_heads, shape.head_dim)  # [num_blocks, block_size, Hkv, D]
        self.k = torch.randn(cache, generator=g, device=DEVICE, dtype=DTYPE)
        self.v = torch.randn(cache, generator=g, device=DEVICE, dtype=DTYPE)
        self.scales = {}
        if KV_FP8:
            self.k, self.v = self.k.to(torch.float8_e4m3fn), self.v.to(torch.float8_e4m3fn)
            one = torch.ones((), dtype=torch.float32, device=DEVICE)
            self.scales = {"k_scale": one, "v_scale": one}
        self.q = torch.randn(batch, shape.heads, shape.head_dim, generator=g, device=DEVICE, dtype=DTYPE)
        perm = torch.randperm(blocks, generator=g, device=DEVICE)[: batch * math.ceil(BOUND / PAGE)]
        self.block_tables = perm.view(batch, -1).to(DEVICE, torch.int32)  # [B, bound / PAGE]
        self.seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
        self.shape, self.out = shape, torch.empty_like(self.q)

    def call(self, cfg: dict | None):
        s = self.shape
        return lambda: pa.paged_attention_decode(self.q, self.k, self.v, self.block_tables, self.seq_lens,
                                                 s.head_dim**-0.5, s.window, None, max_seq_len=BOUND, out=self.out,
                                                 config=cfg, **self.scales)

    def time_ms(self, cfg: dict | None) -> tuple[float, torch.Tensor]:
        fn = self.call(cfg)
        fn()
        result = self.out.clone()
        if SMOKE:
            return 1.0, result
        import triton.testing
        from attention_kernels import capture

        graph = capture(fn)
        return triton.testing.do_bench(graph.replay, warmup=5, rep=25, return_mode="median"), result


def sweep_shape(shape: AttentionShape) -> dict:
    cases = [Case(shape, b, c) for b, c in CASES]
    defaults = [case.time_ms(None) for case in cases]
    rows = []
    for cfg in CANDIDATES:
        times, worst_err = [], 0.0
        try:
            for case, (_, ref) in zip(cases, defaults):
                ms, out = case.time_ms(cfg)
                times.append(ms)
                worst_err = max(worst_err, ((out.float() - ref.float()).norm() / ref.float().norm()).item())
        except Exception as e:  # registers or shared memory: out of the running
            print(f"{shape.key} {cfg}: failed {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        ratios = [t / d for t, (d, _) in zip(times, defaults)]
        geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
        rows.append({"config": cfg, "ms": times, "ratios": ratios, "geomean": geo, "rel_err": worst_err})
    ok = [r for r in rows if r["rel_err"] < 1e-2 and max(r["ratios"]) <= WORST]
    best = min(ok, key=lambda r: r["geomean"], default=None)
    print(f"{shape.key} {shape}: defaults {[round(d, 4) for d, _ in defaults]} ms; best "
          f"{None if best is None else (best['config'], [round(t, 4) for t in best['ms']], round(best['geomean'], 3))}",
          flush=True)
    return {"shape": asdict(shape), "cases": CASES, "defaults_ms": [d for d, _ in defaults], "rows": rows,
            "best": best, "entry": best["config"] if best is not None and best["geomean"] < WIN else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--model", default="gemma4", choices=MODELS)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--kv", default="bf16", choices=("bf16", "fp8"), help="the KV cache's dtype")
    args = ap.parse_args()
    global KV_FP8
    KV_FP8 = args.kv == "fp8"
    args.out.mkdir(parents=True, exist_ok=True)
    package = PACKAGES[args.model]
    tuning.use_packages((package,))  # the defaults this model reads today
    results = [sweep_shape(shape) for shape in model_shapes(args.model)]
    table = {r["shape"]["key"]: r["entry"] for r in results if r["entry"] is not None}
    out = {"model": args.model, "package": package, "bound": BOUND, "kv": args.kv, "results": results, "table": table,
           "device": "cpu-interpreter" if SMOKE else torch.cuda.get_device_name()}
    (args.out / "attention_decode_sweep.json").write_text(json.dumps(out, indent=1))
    print(f"entries for {package}: {sorted(table) or 'none (the defaults win)'}")


if __name__ == "__main__":
    main()
