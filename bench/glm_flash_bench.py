"""GLM-4.7-Flash-shaped benchmark: armillary vs the hardware roofline and vs transformers, in one run.

Random bf16 weights at the real config (transformers' ``Glm4MoeLiteConfig()`` defaults), built with
``load_format="dummy"``. Measures, in this order: copy bandwidth; transformers (batch-1 and batch-8
decode, 16K prefill; its model is freed before ours is built); armillary (batch-1 decode with a 1K
prompt and 256 new tokens, 64 streams, 16K prefill); and the latent cache's KV bytes per token per
layer against the same heads as plain attention. Prints one line per figure, then a markdown table;
writes JSON to ``$OUT/glm_flash_bench.json`` when ``$OUT`` is set.

    python bench/glm_flash_bench.py                     # on the GPU
    python bench/glm_flash_bench.py --tiny --device cpu  # smoke test of the driver itself
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from hf_baseline import transformers_baseline, transformers_in_child, without  # the same transformers comparison in every bench
from qwen_bench import Ours, copy_bandwidth  # the same measurement and engine driver in every bench

TARGETS = {"decode tok/s, batch 1": 350.0, "decode tok/s, 64 streams": 3000.0, "prefill tok/s, 16K": 40000.0}


def real_config(tiny: bool) -> dict:
    from transformers import Glm4MoeLiteConfig

    if tiny:
        cfg = Glm4MoeLiteConfig(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                                kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=16, qk_nope_head_dim=16,
                                v_head_dim=32)
    else:
        cfg = Glm4MoeLiteConfig()
    d = cfg.to_dict()
    d["architectures"] = ["Glm4MoeLiteForCausalLM"]
    d["dtype"] = "bfloat16"
    return d


def kv_bytes_per_token_layer(cfg: dict) -> tuple[int, int]:
    """(the latent cache's bytes per token per layer, the same heads' K and V as plain attention), bf16."""
    latent = (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 2
    plain = cfg["num_attention_heads"] * (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"] + cfg["v_head_dim"]) * 2
    return latent, plain


def decode_bytes(cfg: dict, batch: int, context: int) -> float:
    """Bytes one decode step of ``batch`` tokens must move: the weights it touches + the latents it reads."""
    h, v, layers = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    heads, nope = cfg["num_attention_heads"], cfg["qk_nope_head_dim"]
    rope, vd = cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    ql, kl = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    attn = h * ql + ql * heads * (nope + rope) + h * (kl + rope) + kl * heads * (nope + vd) + heads * vd * h
    dense = sum(1 for t in cfg["mlp_layer_types"] if t == "dense")
    e, k, inter = cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
    touched = e * (1 - (1 - k / e) ** batch)  # expected distinct experts for ``batch`` tokens
    moe = (touched + cfg["n_shared_experts"]) * 3 * h * inter
    weights = 2 * (layers * attn + dense * 3 * h * cfg["intermediate_size"] + (layers - dense) * moe + v * h)
    router = (layers - dense) * h * e * 4  # float32 router weights
    latents = batch * layers * kv_bytes_per_token_layer(cfg)[0] * context
    return weights + router + latents


def hf_bench(cfg_dict: dict, device: str, prompt_len: int, new: int, prefill_len: int) -> dict:
    """transformers on the same config, random bf16 weights: decode tok/s at batch 1 and 8, 16K prefill."""
    import transformers as tf

    cfg = tf.Glm4MoeLiteConfig(**without(cfg_dict, "architectures", "dtype"))
    return transformers_baseline(tf.Glm4MoeLiteForCausalLM, cfg, device, prompt_len, new, prefill_len,
                                 vocab_cap=150000, explicit_mask=True, verbose=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a tiny config: checks the driver, measures nothing real")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--out", default=None, help="markdown table file")
    args = ap.parse_args()
    dev = args.device
    cfg = real_config(args.tiny)
    scale = 8 if args.tiny else 1
    p1k, new, p16k = 1024 // scale, 256 // scale, 16384 // scale
    bw = copy_bandwidth(dev)
    print(f"copy bandwidth: {bw / 1e9:.0f} GB/s", flush=True)
    hf = None if args.skip_hf else transformers_in_child(hf_bench, cfg, dev, p1k, 32 // (4 if args.tiny else 1), p16k)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as d:
        Path(d, "config.json").write_text(json.dumps(cfg))
        ours = Ours(Path(d), dev, max_len=p16k + 512, max_seqs=64, eager=args.eager)
        ours.run(1, 64, 4)  # warm-up: compiles kernels outside the timings
        ours.run(1, 2048 // scale, 1)
        b1 = ours.run(1, p1k, new)
        print(f"armillary decode batch 1: {b1['decode_tok_s']:.1f} tok/s", flush=True)
        b64 = ours.run(64, p1k, new // 2)
        print(f"armillary decode 64 streams: {b64['decode_tok_s']:.1f} tok/s", flush=True)
        ours.run(1, p16k, 1)  # the first 16K prompt compiles the long-prefill shapes
        pre16 = ours.run(1, p16k, 1)
        print(f"armillary prefill {p16k}: {p16k / pre16['ttft']:.0f} tok/s", flush=True)
    rows = [("copy bandwidth (GB/s)", f"{bw / 1e9:.0f}", "", "", "")]
    for name, res, batch, ctx in (("decode tok/s, batch 1", b1, 1, p1k + new // 2),
                                  ("decode tok/s, 64 streams", b64, 64, p1k + new // 4)):
        roof = batch * bw / decode_bytes(cfg, batch, ctx) if dev == "cuda" else float("nan")
        hf_val = (hf or {}).get(f"decode_b{batch}" if batch == 1 else "decode_b8")
        tps = res["decode_tok_s"]
        results[name] = {"armillary": tps, "roofline": roof, "transformers": hf_val, "target": TARGETS[name]}
        rows.append((name, f"{tps:.1f}", f"{tps / roof:.0%} of {roof:.0f}",
                     f"{tps / hf_val:.1f}x ({hf_val:.1f}{'' if batch == 1 else ', batch 8'})" if hf_val else "",
                     f"{TARGETS[name]:.0f}"))
    tps = p16k / pre16["ttft"]
    hf_pre = (hf or {}).get("prefill")
    results["prefill tok/s, 16K"] = {"armillary": tps, "ttft_s": pre16["ttft"], "transformers": hf_pre,
                                     "target": TARGETS["prefill tok/s, 16K"]}
    rows.append(("prefill tok/s, 16K", f"{tps:.0f} (TTFT {pre16['ttft'] * 1e3:.0f} ms)", "",
                 f"{tps / hf_pre:.1f}x ({hf_pre:.0f})" if hf_pre else "", f"{TARGETS['prefill tok/s, 16K']:.0f}"))
    latent, plain = kv_bytes_per_token_layer(cfg)
    results["kv bytes per token per layer"] = {"latent": latent, "plain_attention": plain}
    rows.append(("KV bytes / token / layer", f"{latent}", "", f"{plain / latent:.1f}x less than MHA ({plain})", ""))
    rows.append(("engine start-up (s)", f"{ours.startup:.1f}", "", "", ""))
    table = ["| metric | armillary | vs roofline | vs transformers | target |", "|---|---|---|---|---|"]
    table += [f"| {' | '.join(r)} |" for r in rows]
    text = "\n".join(table)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    out = os.environ.get("OUT")
    if out:
        Path(out, "glm_flash_bench.json").write_text(json.dumps({"copy_bandwidth": bw, **results}, indent=1))


if __name__ == "__main__":
    main()
