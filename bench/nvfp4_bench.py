"""NVFP4 benchmark at the Qwen3.6-35B-A3B shape beside bf16 and FP8 in the same run: kernel micro-benchmarks (standalone) and the engine (batch-1 decode, 64 streams, 16K prefill, weight memory).

Phases (``--phase``, comma-separated; one line per figure, JSON to ``$OUT/nvfp4_bench.json``):

- ``kernels`` (no loader needed): the copy bandwidth; per Qwen projection at M = 1 the NVFP4 skinny
  GEMM, the FP8 skinny GEMM and bf16 cuBLAS (µs, GB/s of the bytes each must stream, % of the
  copy bandwidth); at M = 8 / 64 the same; prefill at 256 .. 16384 rows: the three NVFP4 variants
  (bf16 dequantized tile, fp8 re-rounded tile, whole weight unpacked then cuBLAS) vs the FP8 block
  GEMM and bf16 cuBLAS (TFLOP/s); the fused MoE at 1 / 8 / 64 / 2048 tokens, NVFP4 (GEMV / grouped,
  and unpacked experts + the bf16 MoE) vs FP8 vs bf16 Triton, under the Qwen plugin's launch tables (as the
  served model reads them). Timings replay CUDA graphs over rotated weight copies (HBM, not L2), as
  bench/fp8_gpu_checks.py.
- ``sweep``: bench/fp4_skinny_sweep.py and bench/fp4_moe_gemv_sweep.py (the ``fp4_skinny`` / ``fp4_moe_gemv``
  launch tables; their ``--write`` merges into the Qwen plugin's tuning/sm_90.json), results under $OUT.
- ``speed``: the engine on random weights (``load_format="dummy"``) for bf16, FP8 (``fp8_block``)
  and NVFP4 (``quantization="nvfp4"``: the bf16 weights quantized while loading), bf16 KV for all:
  batch-1 decode (1K prompt, 256 new), 64 streams (1K prompt, 128 new), 2K and 16K prefill, the weights'
  bytes on the GPU and NVFP4 / bf16 ratios; decode against the weight-streaming roofline.

    python bench/nvfp4_bench.py --phase kernels,sweep
    python bench/nvfp4_bench.py --phase speed
    TRITON_INTERPRET=1 python bench/nvfp4_bench.py --tiny --device cpu --phase kernels   # the driver itself
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fp8_bench import kv_bytes_per_token  # noqa: E402
from fp8_gpu_checks import bench_us  # noqa: E402
from qwen_bench import Ours, copy_bandwidth, real_config  # noqa: E402

from armillary.kernels import fp4 as ref  # noqa: E402
from armillary.kernels import fp8 as fp8_ref  # noqa: E402
from armillary.kernels import tuning  # noqa: E402
from armillary.kernels.triton import fp4_gemm, fp4_moe, fp8_gemm, fp8_moe  # noqa: E402
from armillary.kernels.triton import moe as bf16_moe  # noqa: E402

RESULTS: dict[str, float] = {}
LINEARS = {"attn_qkv": (8192 + 2 * 512, 2048), "attn_o": (2048, 4096), "gdn_in_qkvz": (12288, 2048),
           "gdn_out": (2048, 4096)}
FP4_BYTES = 0.5 + 1 / 16  # per weight: the e2m1 code and its share of the e4m3 group scale


def report(name: str, value: float, note: str = "") -> None:
    RESULTS[name] = value
    print(f"{name}: {value:.4g}{'  ' + note if note else ''}", flush=True)


def copies(nbytes: float, tiny: bool) -> int:
    """Weight copies rotated through so a timing streams from HBM, not from the 50 MB L2."""
    return 1 if tiny else max(2, -(-256 * 2 ** 20 // max(int(nbytes), 1)))


def weights(n: int, k: int, dev: str, count: int) -> dict:
    """``count`` copies of one random weight in bf16, FP8 128 x 128 blocks and NVFP4."""
    w = torch.randn(n, k, device=dev) * 0.02
    packed, scale, g = ref.quantize_nvfp4(w)
    g = ref.row_global_scale(g, n).to(dev)
    q8, s8 = fp8_ref.quantize_blocks(w, 128, 128)
    one = dict(bf16=w.bfloat16(), fp8=(q8, s8), fp4=(packed, scale, g))
    out = {key: [val] for key, val in one.items()}
    for _ in range(count - 1):
        out["bf16"].append(one["bf16"].clone())
        out["fp8"].append(tuple(t.clone() for t in one["fp8"]))
        out["fp4"].append(tuple(t.clone() for t in one["fp4"]))
    return out


def phase_kernels(dev: str, tiny: bool, bw: float) -> None:
    linears = {"attn_o": (96, 160)} if tiny else LINEARS
    act = torch.float16 if tiny else torch.bfloat16  # the interpreter's bf16 tl.dot is wrong
    for name, (n, k) in linears.items():
        count = copies(n * k * 2, tiny)
        ws = weights(n, k, dev, count)
        for m in ((1, 3) if tiny else (1, 8, 64)):
            x = torch.randn(m, k, device=dev, dtype=act)
            times = {
                "fp4": bench_us(lambda i: fp4_gemm.fp4_linear(x, *ws["fp4"][i % count]), count * 4),
                "fp8": bench_us(lambda i: fp8_gemm.fp8_linear(x, *ws["fp8"][i % count], 128, 128), count * 4),
                "bf16": bench_us(lambda i: F.linear(x, ws["bf16"][i % count].to(act)), count * 4),
            }
            streamed = {"fp4": n * k * FP4_BYTES, "fp8": n * k * (1 + 4 / 128 ** 2), "bf16": n * k * 2}
            for kind, us in times.items():
                gbs = (streamed[kind] + m * k * 2 + m * n * 2) / us / 1e3
                report(f"{kind} linear {name} M={m} us", us, f"{gbs:.0f} GB/s, {gbs * 1e9 / bw:.0%} of copy bandwidth")
            report(f"fp4 / fp8 speed-up {name} M={m}", times["fp8"] / times["fp4"])
        for m in ((70,) if tiny else (256, 1024, 2048, 4096, 16384)):  # prefill chunk sizes: the variants' crossover
            x = torch.randn(m, k, device=dev, dtype=act)
            times = {f"fp4 {v}": bench_us(lambda i, v=v: fp4_gemm.fp4_linear(x, *ws["fp4"][i % count],
                                                                              config=dict(variant=v)), 4)
                     for v in ("bf16", "fp8", "dequant")}
            times["fp8"] = bench_us(lambda i: fp8_gemm.fp8_linear(x, *ws["fp8"][i % count], 128, 128), 4)
            times["bf16 cuBLAS"] = bench_us(lambda i: F.linear(x, ws["bf16"][i % count].to(act)), 4)
            for kind, us in times.items():
                report(f"{kind} prefill {name} M={m} us", us, f"{2 * m * n * k / us / 1e6:.0f} TFLOP/s")
        del ws
        gc.collect()
    moe_kernels(dev, tiny, act)


def moe_kernels(dev: str, tiny: bool, act: torch.dtype) -> None:
    e, h, i, top_k = (8, 96, 64, 2) if tiny else (256, 2048, 512, 8)
    w13 = torch.randn(e, 2 * i, h, device=dev) * 0.02
    w2 = torch.randn(e, h, i, device=dev) * 0.02
    p13, s13, g13 = ref.quantize_nvfp4(w13)
    p2, s2, g2 = ref.quantize_nvfp4(w2)
    fp4_w = (p13, s13, ref.row_global_scale(g13, 2 * i).to(dev), p2, s2, ref.row_global_scale(g2, h).to(dev))
    q13, t13 = fp8_ref.quantize_blocks(w13, 128, 128)
    q2, t2 = fp8_ref.quantize_blocks(w2, 128, 128)
    b13, b2 = w13.to(act), w2.to(act)
    del w13, w2
    for t in ((1, 40) if tiny else (1, 8, 64, 2048)):
        x = torch.randn(t, h, device=dev, dtype=act)
        routes = [torch.topk(torch.randn(t, e, device=dev).softmax(-1), top_k, dim=-1)
                  for _ in range(1 if tiny else 16)]  # 16 routings: timings stream other experts, not L2
        n = len(routes)
        times = {
            "fp4": bench_us(lambda j: fp4_moe.fp4_fused_moe(x, *fp4_w, *routes[j % n], "silu"), 16),
            **({"fp4 dequant": bench_us(lambda j: fp4_moe.fp4_fused_moe(x, *fp4_w, *routes[j % n], "silu",
                                                                        grouped="dequant"), 4)}
               if t * top_k > fp4_moe.GEMV_MAX_PAIRS else {}),
            "fp8": bench_us(lambda j: fp8_moe.fp8_fused_moe(x, q13, t13, q2, t2, 128, 128, *routes[j % n], "silu"), 16),
            "bf16": bench_us(lambda j: bf16_moe.fused_moe(x, b13, b2, *routes[j % n], "silu"), 16),
        }
        touched = len(torch.unique(routes[0][1]))
        for kind, us in times.items():
            per = {"fp4": FP4_BYTES, "fp4 dequant": FP4_BYTES, "fp8": 1.0, "bf16": 2.0}[kind]
            gbs = touched * 3 * h * i * per / us / 1e3
            report(f"{kind} fused_moe T={t} us", us, f"{touched} experts, {gbs:.0f} GB/s")
        report(f"fp4 / fp8 fused_moe speed-up T={t}", times["fp8"] / times["fp4"])


def phase_sweep(dev: str, tiny: bool) -> None:
    """The NVFP4 decode launch-table sweeps, each in its own process (bench/fp4_skinny_sweep.py: the GEMV at
    M = 1..8; bench/fp4_moe_gemv_sweep.py: the MoE GEMV at T = 1, 2, 4); results under $OUT, nothing written
    into the tables (run a sweep with --write for that)."""
    import subprocess

    root = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="nvfp4_sweep_"))
    for script in ("fp4_skinny_sweep.py", "fp4_moe_gemv_sweep.py"):
        cmd = [sys.executable, str(Path(__file__).with_name(script)), "--out", str(root / Path(script).stem),
               "--device", dev, "--deadline-s", "110", *(["--tiny", "--tokens", "1"] if tiny else [])]
        print("$", " ".join(cmd[1:]), flush=True)
        report(f"sweep {script} exit status", subprocess.run(cmd).returncode, str(root / Path(script).stem))


def decode_bytes(cfg: dict, batch: int, context: int, per_weight: float) -> float:
    """Bytes one decode step moves: the quantized projections and experts touched (``per_weight`` bytes
    each), bf16 router and LM head, recurrent states read and written, bf16 KV."""
    h, v, layers = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    full = sum(1 for t in cfg["layer_types"] if t == "full_attention")
    lin = layers - full
    hd, nq, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    attn = h * nq * hd * 2 + 2 * h * nkv * hd + nq * hd * h
    kd = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
    vd = cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
    gdn = h * (2 * kd + 2 * vd + 2 * cfg["linear_num_value_heads"]) + vd * h
    e, k, inter = cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
    touched = e * (1 - (1 - k / e) ** batch)
    moe = (touched + 1) * 3 * h * inter
    quantized = (full * attn + lin * gdn + layers * moe) * per_weight
    state = batch * lin * cfg["linear_num_value_heads"] * cfg["linear_key_head_dim"] * cfg["linear_value_head_dim"] * 8
    return quantized + 2 * (layers * h * (e + 1) + v * h) + state + batch * context * kv_bytes_per_token(cfg, 0)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers on the device (shared storage counted once)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type != "meta" and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def phase_speed(path: Path, cfg: dict, args, bw: float, s: int) -> None:
    kinds = {"bf16": {}, "fp8": dict(quantization="fp8_block"), "nvfp4": dict(quantization="nvfp4")}
    kinds = {kind: kinds[kind] for kind in args.kinds.split(",")}
    per_weight = {"bf16": 2.0, "fp8": 1 + 4 / 128 ** 2, "nvfp4": FP4_BYTES}
    memory, decode = {}, {}
    for kind, kw in kinds.items():
        try:
            ours = Ours(path, args.device, max_len=16384 // s + 512, max_seqs=64, eager=args.eager,
                        kv_cache_dtype="auto", **kw)
        except Exception as exc:  # e.g. the loader not there yet: the other kinds still run
            print(f"{kind}: engine failed to start: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        memory[kind] = weight_bytes(ours.engine.model)
        report(f"{kind} weight GB", memory[kind] / 1e9)
        report(f"{kind} engine start-up s", ours.startup)
        ours.run(1, 64, 4)  # warm-up: kernels compile outside the timings
        ours.run(1, 2048 // s, 1)
        for name, batch, prompt, new in (("decode tok/s batch 1", 1, 1024 // s, 256 // s),
                                         ("decode tok/s 64 streams", 64, 1024 // s, 128 // s)):
            res = ours.run(batch, prompt, new)
            roof = batch * bw / decode_bytes(cfg, batch, prompt + new // 2, per_weight[kind])
            decode[(kind, batch)] = res["decode_tok_s"]
            report(f"{kind} {name}", res["decode_tok_s"], f"{res['decode_tok_s'] / roof:.0%} of roofline {roof:.0f}")
        for label, n in (("2K", 2048 // s), ("16K", 16384 // s)):
            res = ours.run(1, n, 1)
            report(f"{kind} prefill tok/s {label}", n / res["ttft"], f"TTFT {res['ttft'] * 1e3:.0f} ms")
        ours.llm.shutdown()  # start-up's gc.freeze keeps a dropped engine's memory: the next kind needs it
        del ours
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if "nvfp4" in memory and "bf16" in memory:
        report("nvfp4 / bf16 weight memory", memory["nvfp4"] / memory["bf16"], "(issue 19: <= 0.30)")
    for batch in (1, 64):
        for base in ("bf16", "fp8"):
            if ("nvfp4", batch) in decode and (base, batch) in decode:
                report(f"nvfp4 / {base} decode batch {batch}", decode[("nvfp4", batch)] / decode[(base, batch)])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes: checks the driver, measures nothing real")
    ap.add_argument("--phase", default="kernels")
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--kinds", default="bf16,fp8,nvfp4", help="speed: the engines to run, comma-separated")
    args = ap.parse_args()
    bw = copy_bandwidth(args.device)
    report("copy bandwidth GB/s", bw / 1e9)
    for phase in args.phase.split(","):
        if phase == "kernels":
            with tuning.overlay("armillary_qwen_gdn_moe"):  # the launch tables the served Qwen model reads
                phase_kernels(args.device, args.tiny, bw)
        elif phase == "sweep":
            phase_sweep(args.device, args.tiny)
        elif phase == "speed":
            cfg = real_config(args.tiny)
            with tempfile.TemporaryDirectory() as d:
                path = Path(d)
                (path / "config.json").write_text(json.dumps(cfg))
                phase_speed(path, cfg, args, bw, 16 if args.tiny else 1)
        else:
            raise SystemExit(f"unknown phase {phase!r}: kernels, sweep, speed")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "nvfp4_bench.json").write_text(json.dumps(RESULTS, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
