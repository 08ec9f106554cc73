"""torch's grouped GEMMs (``torch._grouped_mm``, ``F.scaled_grouped_mm``) against core's Triton MoE, per MoE call.

    python bench/grouped_mm_probe.py [--tokens 64,2048,16384] [--models qwen,glm]

At the Qwen3.6-35B-A3B expert shape (257 × 2048 × 512 with the shared expert, k 9) and GLM-4.7-Flash's (65 ×
2048 × 1536, k 5), bf16, random weights and routing: times core's ``fused_moe`` (the plugin's tables) and a
pipeline of permute → ``_grouped_mm`` (gate | up) → SiLU · up → ``_grouped_mm`` (down) → un-permute →
weighted sum (the GEMMs alone too), and tries the fp8 block-scaled grouped GEMM torch offers; prints µs, TFLOP/s
and each output's error against core's. On the GPU only: a probe that decides whether a torch-grouped MoE path is worth
building.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from grouped_search import error_ratio, events_us  # noqa: E402

from armillary.kernels import tuning  # noqa: E402
from armillary.kernels.activation import act_and_mul  # noqa: E402
from armillary.kernels.triton import moe  # noqa: E402

SHAPES = {"qwen": (257, 2048, 512, 9, 1, "armillary_qwen_gdn_moe"),
          "glm": (65, 2048, 1536, 5, 1, "armillary_glm_flash")}


def routed(tokens: int, experts: int, hidden: int, k: int, shared: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(tokens, experts - shared, generator=g).argsort(dim=1)[:, : k - shared]
    ids = torch.cat((ids, torch.arange(experts - shared, experts).expand(tokens, shared)), dim=1)
    weights = torch.rand(tokens, k, generator=g).softmax(-1)
    x = torch.randn(tokens, hidden, generator=g)
    return x.cuda().bfloat16(), weights.cuda(), ids.cuda().int()


def permutation(ids: torch.Tensor, experts: int):
    """(pair order sorted by expert [P], each sorted pair's token [P], group ends [E] int32)."""
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    ends = torch.zeros(experts, dtype=torch.int32, device=ids.device).scatter_add_(
        0, flat.long(), torch.ones_like(flat, dtype=torch.int32)).cumsum(0).int()
    return order, order // ids.shape[1], ends


def grouped_mm_moe(x, w13t, w2t, weights, ids, experts):
    order, tok, ends = permutation(ids, experts)
    xs = x.index_select(0, tok)  # [P, H] in expert order
    up = torch._grouped_mm(xs, w13t, offs=ends)  # [P, 2I]
    h = act_and_mul(up, "silu")
    down = torch._grouped_mm(h, w2t, offs=ends)  # [P, H]
    pairs = torch.empty_like(down).index_copy_(0, order, down)  # back to (token, slot) order
    return moe.sum_topk(pairs, ids.shape[1], torch.empty_like(x), weights)


def try_scaled(x, w13, experts, ends, tok) -> str:
    """Whether F.scaled_grouped_mm takes 1×128 activation blocks with 128×128 weight blocks here."""
    try:
        from armillary.kernels.triton import fp8_gemm
        from armillary.kernels import fp8 as ref
        wq, ws = ref.quantize_blocks(w13.float(), 128, 128)  # [E, N, K] e4m3, [E, N/128, K/128]
        xs = x.index_select(0, tok)
        aq, a_s = fp8_gemm.quantize_act(xs, 128)
        a_s = a_s.t().contiguous()  # [P, K/128]
        st = F.ScalingType
        out = F.scaled_grouped_mm(aq, wq.transpose(1, 2), a_s, st.BlockWise1x128, ws, st.BlockWise128x128,
                                  offs=ends, output_dtype=torch.bfloat16)
        torch.cuda.synchronize()
        return f"ok {tuple(out.shape)}"
    except Exception as e:  # the probe's question: does torch take this recipe on sm_90
        return f"{type(e).__name__}: {str(e)[:300]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="64,2048,16384")
    ap.add_argument("--models", default="qwen,glm")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = ap.parse_args()
    rows = []
    for name in args.models.split(","):
        experts, hidden, inter, k, shared, plugin = SHAPES[name]
        g = torch.Generator(device="cuda").manual_seed(0)
        w13 = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=g) * hidden**-0.5).bfloat16()
        w2 = (torch.randn(experts, hidden, inter, device="cuda", generator=g) * inter**-0.5).bfloat16()
        w13t, w2t = w13.transpose(1, 2), w2.transpose(1, 2)  # [E, H, 2I], [E, I, H] column-major views
        with tuning.overlay(plugin), torch.inference_mode():
            for t in map(int, args.tokens.split(",")):
                x, w, ids = routed(t, experts, hidden, k, shared)
                order, tok, ends = permutation(ids, experts)
                xs = x.index_select(0, tok)
                up = torch._grouped_mm(xs, w13t, offs=ends)
                h = act_and_mul(up, "silu")
                calls = {"core": lambda: moe.fused_moe(x, w13, w2, w, ids, "silu"),
                         "grouped_mm": lambda: grouped_mm_moe(x, w13t, w2t, w, ids, experts),
                         "gemms_only": lambda: torch._grouped_mm(
                             act_and_mul(torch._grouped_mm(xs, w13t, offs=ends), "silu"), w2t, offs=ends),
                         "up_only": lambda: torch._grouped_mm(xs, w13t, offs=ends),
                         "down_only": lambda: torch._grouped_mm(h, w2t, offs=ends),
                         "permute": lambda: permutation(ids, experts)[0]}
                times, outs = {}, {}
                for _ in range(2):
                    for label, fn in calls.items():
                        us, outs[label] = events_us(fn), fn()
                        times[label] = min(us, times.get(label, float("inf")))
                flops = 2 * t * k * 3 * hidden * inter
                row = {"model": name, "tokens": t, **{f"{n}_us": round(v, 1) for n, v in times.items()},
                       "core_tflops": round(flops / times["core"] / 1e6, 1),
                       "grouped_mm_tflops": round(flops / times["grouped_mm"] / 1e6, 1),
                       "gemms_tflops": round(flops / times["gemms_only"] / 1e6, 1),
                       "err": error_ratio(outs["grouped_mm"], outs["core"].float()),
                       "scaled_blockwise": try_scaled(x, w13, experts, ends, tok) if t == 2048 else "-"}
                print(json.dumps(row), flush=True)
                rows.append(row)
    (args.out / "grouped_mm_probe.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows},
                                                               indent=1))


if __name__ == "__main__":
    main()
