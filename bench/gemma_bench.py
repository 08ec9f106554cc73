"""Gemma-3-27B and Gemma-4-26B-A4B benchmark: armillary vs the hardware roofline and vs transformers, in one run.

Random bf16 weights at the published text configs (written below from the checkpoints' config.json),
armillary through ``load_format="dummy"``. Per model, in this order: transformers (batch-1 and
64-stream decode, 16K prefill), then armillary (batch-1 decode with a 1K prompt, 64 streams, 16K
prefill). For Gemma 3 also the KV memory a 32K-token sequence holds (the coordinator's tables
after a real 32K prefill) against full attention in every layer. Prints one line per figure and
writes JSON to ``$OUT/gemma_bench.json`` when ``OUT`` is set.

    python bench/gemma_bench.py                        # both models, on the GPU
    python bench/gemma_bench.py --model gemma3 --skip-hf
    python bench/gemma_bench.py --tiny --device cpu    # smoke test of the driver itself
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from hf_baseline import transformers_baseline, transformers_in_child, without  # the same transformers comparison in every bench
from qwen_bench import copy_bandwidth, sync  # the same measurement in every driver

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "gemma"))  # when not pip-installed

from gemma_gpu_checks import describe  # noqa: E402 - this directory is sys.path[0] when run as a script

GEMMA3_27B = {  # google/gemma-3-27b-it text_config
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262_208,
    "hidden_size": 5376, "intermediate_size": 21504, "num_hidden_layers": 62, "num_attention_heads": 32,
    "num_key_value_heads": 16, "head_dim": 128, "query_pre_attn_scalar": 168, "sliding_window": 1024,
    "sliding_window_pattern": 6, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
    "final_logit_softcapping": None, "attn_logit_softcapping": None, "dtype": "bfloat16",
}
GEMMA4_26B_A4B = {  # google/gemma-4-26B-A4B-it text_config
    "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "vocab_size": 262_144,
    "hidden_size": 2816, "intermediate_size": 2112, "num_hidden_layers": 30, "num_attention_heads": 16,
    "num_key_value_heads": 8, "head_dim": 256, "global_head_dim": 512, "num_global_key_value_heads": 2,
    "attention_k_eq_v": True, "enable_moe_block": True, "num_experts": 128, "top_k_experts": 8,
    "moe_intermediate_size": 704, "sliding_window": 1024, "hidden_size_per_layer_input": 0,
    "num_kv_shared_layers": 0, "use_double_wide_mlp": False, "final_logit_softcapping": 30.0,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 5, "max_position_embeddings": 262_144,
    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                           "rope_theta": 1_000_000.0}},
    "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
    "dtype": "bfloat16",
}
TINY = {"gemma3": dict(GEMMA3_27B, vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                       sliding_window=32),
        "gemma4": dict(GEMMA4_26B_A4B, vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                       num_global_key_value_heads=1, num_experts=8, top_k_experts=2, moe_intermediate_size=32,
                       sliding_window=32, layer_types=["sliding_attention"] * 5 + ["full_attention"])}
TARGETS = {"gemma3": "batch-1 decode >= 65 tok/s", "gemma4": "batch-1 decode >= 55% of the roofline"}


def _layer_shapes(cfg: dict) -> list[tuple[str, int, int]]:
    """(type, kv heads, head_dim) per layer, as the plugin resolves them."""
    from armillary.hf_config import HFConfig
    from armillary_gemma.config import GemmaArgs

    return [(la.kind, la.num_kv_heads, la.head_dim) for la in GemmaArgs.from_hf(HFConfig(cfg)).layers]


def decode_bytes(cfg: dict, batch: int, context: int) -> float:
    """Bytes one decode step must move for ``batch`` tokens: the weights it touches (bf16; the tied
    head read once) and each sequence's keys and values (sliding layers: the window)."""
    h, v, nq = cfg["hidden_size"], cfg["vocab_size"], cfg["num_attention_heads"]
    weights, kv = v * h, 0
    k_eq_v = cfg.get("attention_k_eq_v", False)
    for kind, hkv, d in _layer_shapes(cfg):
        global_kv = k_eq_v and kind == "full_attention"
        weights += h * nq * d * 2 + h * hkv * d * (1 if global_kv else 2) + 4 * h  # q, o, k (, v), norms
        weights += 3 * h * cfg["intermediate_size"]
        if cfg.get("enable_moe_block"):
            e, k, inter = cfg["num_experts"], cfg["top_k_experts"], cfg["moe_intermediate_size"]
            touched = e * (1 - (1 - k / e) ** batch)  # expected distinct experts for ``batch`` tokens
            weights += touched * 3 * h * inter + h * e
        tokens = min(context, cfg["sliding_window"]) if kind == "sliding_attention" else context
        kv += batch * 2 * hkv * d * 2 * tokens
    return 2 * weights + kv


def _registry():
    import armillary_gemma.hooks as hooks
    from armillary.registry import PluginRegistry

    registry = PluginRegistry()
    registry.register(hooks, "gemma", distribution="armillary-gemma")
    return registry


class Ours:
    def __init__(self, path: Path, device: str, max_len: int, max_seqs: int, eager: bool) -> None:
        from armillary import LLM

        t = time.perf_counter()
        self.llm = LLM(str(path), registry=_registry(), load_format="dummy", dtype="bfloat16", device=device,
                       max_model_len=max_len, max_num_seqs=max_seqs, max_num_batched_tokens=16384,
                       enforce_eager=eager, gpu_memory_utilization=0.88)
        self.startup = time.perf_counter() - t
        self.engine, self.device, self.ids = self.llm.engine, device, 0
        self.vocab = min(self.engine.hf_config.vocab_size, 250_000)

    def _prompt(self, n: int) -> list[int]:
        g = torch.Generator().manual_seed(n + self.ids)
        return torch.randint(10, self.vocab, (n,), generator=g).tolist()

    def run(self, batch: int, prompt_len: int, new: int, probe=None) -> dict:
        """``batch`` requests at once: TTFT, and decode tok/s once every prefill is done. ``probe(engine)``
        runs after each step (the KV tables are read there)."""
        from armillary import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
        sync(self.device)
        t0 = time.perf_counter()
        for _ in range(batch):
            self.ids += 1
            self.engine.add_request(f"b{self.ids}", self._prompt(prompt_len), params)
        first: dict[str, float] = {}
        counts: dict[str, int] = {}
        t_all_first, tokens_at = None, 0
        while self.engine.has_unfinished_requests():
            outs = self.engine.step()
            now = time.perf_counter()
            if probe is not None:
                probe(self.engine)
            for o in outs:
                counts[o.request_id] = len(o.outputs[0].token_ids)
                first.setdefault(o.request_id, now)
            if t_all_first is None and len(first) == batch:
                t_all_first, tokens_at = now, sum(counts.values())
        sync(self.device)
        t_end = time.perf_counter()
        decoded = sum(counts.values()) - tokens_at
        return {"ttft": min(first.values()) - t0,
                "decode_tok_s": decoded / (t_end - t_all_first) if decoded else float("nan")}


def kv_held_ratio(ours: Ours, cfg: dict, length: int) -> dict:
    """Bytes the coordinator holds for one ``length``-token sequence (after its prefill, while it decodes)
    over what full attention in every layer would hold: 2 · Hkv · D · 2 bytes per token per layer."""
    seen: list[int] = []

    def probe(engine) -> None:
        for seq in engine.scheduler.running:
            if seq.num_computed_tokens >= length:
                held = {b for g in engine.cache.paged for b in g.table(seq) if b != 0}
                seen.append(len(held))

    ours.run(1, length, 4, probe=probe)
    held = max(seen) * ours.engine.plan.bytes_per_block  # a block id is one page at every storage position
    full = sum(2 * hkv * d * 2 for _, hkv, d in _layer_shapes(cfg)) * length
    return {"held_bytes": held, "full_attention_bytes": full, "ratio": held / full}


def hf_bench(cfg_dict: dict, device: str, prompt_len: int, new: int, prefill_len: int) -> dict:
    """transformers on the same config, random bf16 weights: decode tok/s at batch 1 and 64, 16K prefill."""
    import transformers as tf

    gemma3 = cfg_dict["model_type"] == "gemma3_text"
    config_cls, model_cls = ((tf.Gemma3TextConfig, tf.Gemma3ForCausalLM) if gemma3
                             else (tf.Gemma4TextConfig, tf.Gemma4ForCausalLM))
    cfg = config_cls(**without(cfg_dict, "architectures", "model_type", "dtype"))
    return transformers_baseline(model_cls, cfg, device, prompt_len, new, prefill_len, batches=(1, 64),
                                 vocab_cap=250_000)


def bench_model(name: str, cfg: dict, args, bw: float) -> dict:
    dev, scale = args.device, 16 if args.tiny else 1
    p1k, new, p16k, p32k = 1024 // scale, 128 // scale, 16384 // scale, 32768 // scale
    out: dict = {"model": name, "target": TARGETS[name]}
    hf = None
    if not args.skip_hf:
        hf = transformers_in_child(hf_bench, cfg, dev, p1k, 32 // (4 if args.tiny else 1), p16k)
    with tempfile.TemporaryDirectory() as d:
        Path(d, "config.json").write_text(json.dumps(cfg))
        max_len = (p32k if name == "gemma3" else p16k) + 512
        ours = Ours(Path(d), dev, max_len=max_len, max_seqs=64, eager=args.eager)
        ours.run(1, 64, 4)  # warm-up: compiles kernels outside the timings
        b1, b64 = ours.run(1, p1k, new), ours.run(64, p1k, new // 2)
        pre16 = ours.run(1, p16k, 1)
        if name == "gemma3":
            out["kv_32k"] = kv_held_ratio(ours, cfg, p32k)
        out["startup_s"] = ours.startup
        ours.llm.shutdown()  # its weights and caches back before the next model loads
        del ours
        gc.collect()
        if dev == "cuda":
            torch.cuda.empty_cache()
    for label, res, batch in (("decode_b1", b1, 1), ("decode_b64", b64, 64)):
        roof = batch * bw / decode_bytes(cfg, batch, p1k + new // 2)
        out[label] = {"tok_s": res["decode_tok_s"], "roofline": roof, "of_roofline": res["decode_tok_s"] / roof,
                      "transformers": (hf or {}).get(label)}
    out["prefill_16k"] = {"tok_s": p16k / pre16["ttft"], "ttft_ms": pre16["ttft"] * 1e3,
                          "transformers": (hf or {}).get("prefill")}
    return out


def report(r: dict) -> None:
    name = r["model"]
    for label in ("decode_b1", "decode_b64"):
        m = r[label]
        hf = m["transformers"]
        vs = f", {m['tok_s'] / hf:.1f}x transformers ({hf:.1f})" if hf else ""
        print(f"{name} {label}: {m['tok_s']:.1f} tok/s ({m['of_roofline']:.0%} of roofline {m['roofline']:.0f}){vs}")
    p = r["prefill_16k"]
    vs = f", {p['tok_s'] / p['transformers']:.1f}x transformers ({p['transformers']:.0f})" if p["transformers"] else ""
    print(f"{name} prefill 16K: {p['tok_s']:.0f} tok/s (TTFT {p['ttft_ms']:.0f} ms){vs}")
    if "kv_32k" in r:
        k = r["kv_32k"]
        print(f"{name} KV per 32K sequence: {k['held_bytes'] / 2**30:.2f} GiB vs full attention "
              f"{k['full_attention_bytes'] / 2**30:.2f} GiB = {k['ratio']:.3f} (target <= 0.25)")
    print(f"{name} start-up: {r['startup_s']:.1f} s; target: {r['target']}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", choices=["gemma3", "gemma4", "both"], default="both")
    ap.add_argument("--tiny", action="store_true", help="tiny configs: checks the driver, measures nothing real")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--eager", action="store_true")
    args = ap.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # figures appear as they are measured
    bw = copy_bandwidth(args.device)
    if args.device != "cuda":
        bw = 1e11  # a stand-in so the CPU smoke run prints numbers
    print(f"copy bandwidth: {bw / 1e9:.0f} GB/s")
    results, failed = [], []
    for name in (["gemma3", "gemma4"] if args.model == "both" else [args.model]):
        cfg = TINY[name] if args.tiny else {"gemma3": GEMMA3_27B, "gemma4": GEMMA4_26B_A4B}[name]
        try:
            results.append(bench_model(name, cfg, args, bw))
        except Exception as e:  # noqa: BLE001 - the other model still runs; the traceback's tail says where
            failed.append(name)
            print(f"{name} FAILED: {describe(e)}")
            print(traceback.format_exc()[-4000:], flush=True)
        else:
            report(results[-1])
        gc.collect()  # out of the except block: the traceback's frames (the engine) are released by now
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gemma_bench.json").write_text(json.dumps({"copy_bw": bw, "results": results,
                                                                          "failed": failed}, indent=1))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
