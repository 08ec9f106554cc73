"""Qwen3.6-35B-A3B-shaped benchmark: armillary vs the hardware roofline and vs transformers, in one run.

Random weights at the real config (transformers' ``Qwen3_5MoeTextConfig()`` defaults), built with
``load_format="dummy"``. Measures, in this order: copy bandwidth; transformers (batch-1 and
batch-8 decode, 16K prefill); armillary (batch-1 decode with a 1K prompt and 256 new tokens,
8 and 64 streams, prefill + time to first token at 2K and 16K). Prints one table (markdown)
and writes it to ``--out``.

    python bench/qwen_bench.py --out results.md            # on the GPU
    python bench/qwen_bench.py --tiny --device cpu         # smoke test of the driver itself
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from hf_baseline import transformers_baseline, transformers_in_child, without  # the same transformers comparison in every bench


def real_config(tiny: bool) -> dict:
    from transformers import Qwen3_5MoeTextConfig

    if tiny:
        cfg = Qwen3_5MoeTextConfig(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                                   linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                                   num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                   shared_expert_intermediate_size=32)
    else:
        cfg = Qwen3_5MoeTextConfig()
    d = cfg.to_dict()
    d["architectures"] = ["Qwen3_5MoeForCausalLM"]
    d["dtype"] = "bfloat16"
    return d


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: str) -> float:
    """Bytes read + written per second by a device-to-device copy of 2 GiB."""
    if device != "cuda":
        return float("nan")
    src = torch.empty(1 << 30, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    t = time.perf_counter()
    n = 20
    for _ in range(n):
        dst.copy_(src)
    sync(device)
    dt = (time.perf_counter() - t) / n
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (1 << 31) / dt


def decode_bytes(cfg: dict, batch: int, context: int) -> float:
    """Bytes a decode step must move for ``batch`` tokens: weights touched + recurrent states + KV."""
    h, v, layers = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    full = sum(1 for t in cfg["layer_types"] if t == "full_attention")
    lin = layers - full
    hd, nq, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    attn = h * nq * hd * 2 + 2 * h * nkv * hd + nq * hd * h
    kd = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
    vd = cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
    gdn = h * (2 * kd + 2 * vd + 2 * cfg["linear_num_value_heads"]) + vd * h + (2 * kd + vd) * 4
    e, k, inter = cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
    expert = 3 * h * inter
    touched = e * (1 - (1 - k / e) ** batch)  # expected distinct experts for ``batch`` tokens
    moe = touched * expert + 3 * h * cfg["shared_expert_intermediate_size"] + h * e
    weights = 2 * (full * attn + lin * gdn + layers * moe + v * h)  # bf16; lm_head read once
    state = batch * lin * cfg["linear_num_value_heads"] * cfg["linear_key_head_dim"] * cfg["linear_value_head_dim"] * 4 * 2
    kv = batch * full * 2 * nkv * hd * 2 * context
    return weights + state + kv


class Ours:
    def __init__(self, path: Path, device: str, max_len: int, max_seqs: int, eager: bool, **engine_args) -> None:
        from armillary import LLM

        t = time.perf_counter()
        self.llm = LLM(str(path), load_format="dummy", dtype="bfloat16", device=device, max_model_len=max_len,
                       max_num_seqs=max_seqs, max_num_batched_tokens=16384, enforce_eager=eager,
                       gpu_memory_utilization=0.88, **engine_args)
        self.startup = time.perf_counter() - t
        self.engine = self.llm.engine
        self.device = device
        self.vocab = min(self.engine.hf_config.vocab_size, 150000)
        self.ids = 0

    def _prompt(self, n: int) -> list[int]:
        g = torch.Generator().manual_seed(n + self.ids)
        return torch.randint(10, self.vocab, (n,), generator=g).tolist()

    def run(self, batch: int, prompt_len: int, new: int) -> dict:
        """Submit ``batch`` requests at once; returns TTFT, and decode tok/s after every prefill is done."""
        from armillary import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
        sync(self.device)
        t0 = time.perf_counter()
        for _ in range(batch):
            self.ids += 1
            self.engine.add_request(f"b{self.ids}", self._prompt(prompt_len), params)
        first: dict[str, float] = {}
        counts: dict[str, int] = {}
        t_all_first = None
        tokens_at = 0
        while self.engine.has_unfinished_requests():
            outs = self.engine.step()
            now = time.perf_counter()
            for o in outs:
                counts[o.request_id] = len(o.outputs[0].token_ids)
                first.setdefault(o.request_id, now)
            if t_all_first is None and len(first) == batch:
                t_all_first, tokens_at = now, sum(counts.values())
        sync(self.device)
        t_end = time.perf_counter()
        decoded = sum(counts.values()) - tokens_at
        return {"ttft": min(first.values()) - t0, "ttft_last": max(first.values()) - t0,
                "decode_tok_s": decoded / (t_end - t_all_first) if decoded else float("nan"),
                "total_s": t_end - t0}


def hf_bench(cfg_dict: dict, device: str, prompt_len: int, new: int, prefill_len: int) -> dict:
    """transformers on the same config, random bf16 weights: decode tok/s at batch 1 and 8, 16K prefill."""
    import transformers as tf

    cfg = tf.Qwen3_5MoeTextConfig(**without(cfg_dict, "architectures"))
    return transformers_baseline(tf.Qwen3_5MoeForCausalLM, cfg, device, prompt_len, new, prefill_len,
                                 vocab_cap=150000)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a tiny config: checks the driver, measures nothing real")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = args.device
    cfg = real_config(args.tiny)
    scale = 8 if args.tiny else 1
    p1k, new, p2k, p16k = 1024 // scale, 256 // scale, 2048 // scale, 16384 // scale
    bw = copy_bandwidth(dev)
    rows = [("copy bandwidth (GB/s)", f"{bw / 1e9:.0f}", "", "")]
    hf = None if args.skip_hf else transformers_in_child(hf_bench, cfg, dev, p1k, 32 // (4 if args.tiny else 1), p16k)
    with tempfile.TemporaryDirectory() as d:
        Path(d, "config.json").write_text(json.dumps(cfg))
        ours = Ours(Path(d), dev, max_len=p16k + 512, max_seqs=64, eager=args.eager)
        ours.run(1, 64, 4)  # warm-up: compiles kernels outside the timings
        ours.run(1, p2k, 1)
        b1 = ours.run(1, p1k, new)
        b8 = ours.run(8, p1k, new)
        b64 = ours.run(64, p1k, new // 2)
        pre2 = ours.run(1, p2k, 1)
        pre16 = ours.run(1, p16k, 1)
    ctx = p1k + new // 2
    for name, res, batch in (("decode tok/s, batch 1", b1, 1), ("decode tok/s, 8 streams", b8, 8),
                             ("decode tok/s, 64 streams", b64, 64)):
        roof = batch * bw / decode_bytes(cfg, batch, ctx) if dev == "cuda" else float("nan")
        hf_val = (hf or {}).get(f"decode_b{batch}")
        rows.append((name, f"{res['decode_tok_s']:.1f}", f"{res['decode_tok_s'] / roof:.0%} of {roof:.0f}",
                     f"{res['decode_tok_s'] / hf_val:.1f}x ({hf_val:.1f})" if hf_val else ""))
    for name, res, n in (("prefill tok/s, 2K", pre2, p2k), ("prefill tok/s, 16K", pre16, p16k)):
        tps = n / res["ttft"]
        hf_val = (hf or {}).get("prefill") if n == p16k else None
        rows.append((name, f"{tps:.0f} (TTFT {res['ttft'] * 1e3:.0f} ms)", "",
                     f"{tps / hf_val:.1f}x ({hf_val:.0f})" if hf_val else ""))
    rows.append(("engine start-up (s)", f"{ours.startup:.1f}", "", ""))
    table = ["| metric | armillary | vs roofline | vs transformers |", "|---|---|---|---|"]
    table += [f"| {a} | {b} | {c} | {e} |" for a, b, c, e in rows]
    text = "\n".join(table)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
