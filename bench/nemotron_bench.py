"""Nemotron-3-Nano-30B-A3B-shaped benchmark: armillary vs the hardware roofline and vs transformers, in one run.

Random bf16 weights at the real config (``nano_config``: 52 layers "MEMEM*E...", hidden 2688, 128
experts top-6 relu², Mamba-2 64 heads x 64, state 128, 8 groups, 32/2 attention heads x 128;
transformers 5's ``NemotronHConfig()`` defaults are not this model), built with ``load_format="dummy"``;
the router's correction biases are zeroed afterwards (dummy weights make them dominate the tiny
random logits, so every token would pick the same six experts). Measures, in this order: copy
bandwidth; transformers (batch-1 and batch-8 decode, 16K prefill; its Mamba-2 is the torch fallback
unless mamba_ssm is installed); armillary (batch-1 decode with a 1K prompt and 256 new tokens, 8 and
64 streams, prefill + TTFT at 2K and 16K). Targets (issue 14): batch 1 >= 400 tok/s, 64 streams
>= 3,000 tok/s, 16K prefill >= 60K tok/s. Prints one markdown table, one line per figure, and
writes it to ``--out`` (and JSON to ``$OUT/nemotron_bench.json`` when ``$OUT`` is set).

    python bench/nemotron_bench.py --out results.md        # on the GPU
    python bench/nemotron_bench.py --tiny --device cpu     # smoke test of the driver itself
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch

from hf_baseline import transformers_baseline, transformers_in_child, without  # the same transformers comparison in every bench
from qwen_bench import Ours as QwenOurs, copy_bandwidth  # the same measurement and driver in every bench

NANO_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"


def nano_config(tiny: bool) -> dict:
    from transformers import NemotronHConfig

    if tiny:
        cfg = NemotronHConfig(vocab_size=512, hidden_size=64, hybrid_override_pattern="MEM*E", num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, mamba_num_heads=4, mamba_head_dim=16, n_groups=2,
                              ssm_state_size=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                              moe_shared_expert_intermediate_size=64, chunk_size=32)
    else:
        cfg = NemotronHConfig(
            vocab_size=131072, hidden_size=2688, hybrid_override_pattern=NANO_PATTERN, num_attention_heads=32,
            num_key_value_heads=2, head_dim=128, intermediate_size=1856, mamba_num_heads=64, mamba_head_dim=64,
            n_groups=8, ssm_state_size=128, conv_kernel=4, chunk_size=128, n_routed_experts=128,
            num_experts_per_tok=6, moe_intermediate_size=1856, moe_shared_expert_intermediate_size=3712,
            routed_scaling_factor=2.5, n_group=1, topk_group=1, norm_topk_prob=True, layer_norm_epsilon=1e-5,
            max_position_embeddings=262144, tie_word_embeddings=False)
    d = cfg.to_dict()
    d["architectures"] = ["NemotronHForCausalLM"]
    d["dtype"] = "bfloat16"
    return d


def decode_bytes(cfg: dict, batch: int, context: int) -> float:
    """Bytes a decode step must move for ``batch`` tokens: weights touched + Mamba states + KV."""
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    kinds = cfg["layers_block_type"]
    n_mamba, n_moe, n_attn = (sum(1 for k in kinds if k == t) for t in ("linear_attention", "moe", "full_attention"))
    heads, p, g, n = cfg["mamba_num_heads"], cfg["mamba_head_dim"], cfg["n_groups"], cfg["ssm_state_size"]
    d_inner, conv_dim = heads * p, heads * p + 2 * g * n
    mamba = 2 * (h * (d_inner + conv_dim + heads) + d_inner * h)  # bf16 in_proj + out_proj
    mamba_state = batch * (heads * p * n * 4 * 2 + conv_dim * (cfg["conv_kernel"] - 1) * 2 * 2)  # read + write
    hd, nq, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    attn = 2 * (h * nq * hd + 2 * h * nkv * hd + nq * hd * h)
    kv = batch * 2 * nkv * hd * 2 * context
    e, k, inter = cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
    touched = e * (1 - (1 - k / e) ** batch)  # expected distinct experts for ``batch`` tokens
    moe = 2 * (touched * 2 * h * inter + 2 * h * cfg["moe_shared_expert_intermediate_size"]) + 4 * h * e  # fp32 router
    return n_mamba * (mamba + mamba_state) + n_attn * (attn + kv) + n_moe * moe + 2 * v * h


class Ours(QwenOurs):
    """The shared engine driver, with the routers' correction bias zeroed (see the module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.vocab = self.engine.hf_config.vocab_size
        with torch.no_grad():
            for layer in self.engine.model.backbone.layers:
                if layer.kind == "moe":
                    layer.mixer.gate.e_score_correction_bias.zero_()


def hf_bench(cfg_dict: dict, device: str, prompt_len: int, new: int, prefill_len: int) -> dict:
    """transformers on the same config, random bf16 weights: decode tok/s at batch 1 and 8, 16K prefill."""
    import transformers as tf

    cfg = tf.NemotronHConfig(**without(cfg_dict, "architectures"))
    return transformers_baseline(tf.NemotronHForCausalLM, cfg, device, prompt_len, new, prefill_len)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a tiny config: checks the driver, measures nothing real")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = args.device
    cfg = nano_config(args.tiny)
    scale = 8 if args.tiny else 1
    p1k, new, p2k, p16k = 1024 // scale, 256 // scale, 2048 // scale, 16384 // scale
    bw = copy_bandwidth(dev)
    rows = [("copy bandwidth (GB/s)", f"{bw / 1e9:.0f}", "", "")]
    figures: dict[str, float] = {"copy_bandwidth_gb_s": bw / 1e9}
    hf = None if args.skip_hf else transformers_in_child(hf_bench, cfg, dev, p1k, 32 // (4 if args.tiny else 1), p16k)
    with tempfile.TemporaryDirectory() as d:
        Path(d, "config.json").write_text(json.dumps(cfg))
        ours = Ours(Path(d), dev, max_len=p16k + 512, max_seqs=64, eager=args.eager)
        ours.run(1, 64, 4)  # warm-up: compiles kernels outside the timings
        ours.run(1, p2k, 1)
        ours.run(1, p16k, 1)  # the first 16K prefill of a process also pays allocator growth
        b1 = ours.run(1, p1k, new)
        b8 = ours.run(8, p1k, new)
        b64 = ours.run(64, p1k, new // 2)
        pre2 = ours.run(1, p2k, 1)
        pre16 = ours.run(1, p16k, 1)
    ctx = p1k + new // 2
    targets = {1: 400, 64: 3000}
    for name, res, batch in (("decode tok/s, batch 1", b1, 1), ("decode tok/s, 8 streams", b8, 8),
                             ("decode tok/s, 64 streams", b64, 64)):
        roof = batch * bw / decode_bytes(cfg, batch, ctx) if dev == "cuda" else float("nan")
        hf_val = (hf or {}).get(f"decode_b{batch}")
        target = f", target {targets[batch]}" if batch in targets else ""
        rows.append((name, f"{res['decode_tok_s']:.1f}", f"{res['decode_tok_s'] / roof:.0%} of {roof:.0f}{target}",
                     f"{res['decode_tok_s'] / hf_val:.1f}x ({hf_val:.1f})" if hf_val else ""))
        figures[f"decode_b{batch}_tok_s"] = res["decode_tok_s"]
        figures[f"decode_b{batch}_roofline"] = roof
    for name, res, n in (("prefill tok/s, 2K", pre2, p2k), ("prefill tok/s, 16K", pre16, p16k)):
        tps = n / res["ttft"]
        hf_val = (hf or {}).get("prefill") if n == p16k else None
        target = " (target 60000)" if n == p16k else ""
        rows.append((name, f"{tps:.0f} (TTFT {res['ttft'] * 1e3:.0f} ms){target}", "",
                     f"{tps / hf_val:.1f}x ({hf_val:.0f})" if hf_val else ""))
        figures[f"prefill_{n}_tok_s"] = tps
    rows.append(("engine start-up (s)", f"{ours.startup:.1f}", "", ""))
    figures.update({f"hf_{k}": v for k, v in (hf or {}).items()})
    table = ["| metric | armillary | vs roofline | vs transformers |", "|---|---|---|---|"]
    table += [f"| {a} | {b} | {c} | {e} |" for a, b, c, e in rows]
    text = "\n".join(table)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "nemotron_bench.json").write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
