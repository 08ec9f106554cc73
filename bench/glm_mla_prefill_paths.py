"""GLM-4.7-Flash MLA prefill at a 16K-token fresh prompt (GPU, bf16, real head sizes): the work around the
attention, each route timed (CUDA events, median of 5 after a warm-up) and profiled for the kernels it launches.

- ``mla_rope_store``: latent norm + rotary + cache store (and q's rope dims in place) per ``block_t`` tokens a
  program (1: a token a program, the former launch's mapping), interleaved rotary or not, 20 heads or 1 (which
  part of the work costs), beside the torch reference ops and a plain copy of q;
- keys: ``expanded_keys`` (one Triton pass on a GPU) against one ``torch.cat`` of the nope keys and the broadcast
  rope key;
- SDPA (cuDNN) with the values as the strided view of ``kv_b_proj``'s output against contiguous values, and
  whether the strided call launches copies of its own;
- the output: copied into the step's buffer against used as SDPA returns it.

    python bench/glm_mla_prefill_paths.py [--tokens 16384] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grouped_search import median_event_us as timed  # noqa: E402

from armillary_glm_flash.ops.mla.naive import rope_store_ref
from armillary_glm_flash.ops.mla.prefill import decompressed_attention, expanded_keys
from armillary_glm_flash.ops.mla.rope_store import mla_rope_store

HEADS, DL, DR, NOPE, V = 20, 512, 64, 192, 256


def kernels(fn) -> list[str]:
    """Names of the kernels one call launches, in order."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name[:60] for e in prof.events() if e.device_type.name == "CUDA"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    t = args.tokens
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    bf16 = torch.bfloat16
    res: dict = {"tokens": t, "device": torch.cuda.get_device_name()}

    # rope store
    q0 = torch.randn(t, HEADS, NOPE + DR, device=dev, generator=g).to(bf16)
    ckv = torch.randn(t, DL + DR + 768, device=dev, generator=g).to(bf16)[:, 768:]  # strided rows, as the split
    norm_w = (1 + 0.1 * torch.randn(DL, device=dev, generator=g)).to(bf16)
    angles = torch.rand(t, DR // 2, device=dev, generator=g) * 6
    cos, sin = angles.cos(), angles.sin()
    kv = torch.zeros(t // 64 + 8, 64, DL + DR, dtype=bf16, device=dev)
    slots = torch.arange(t, device=dev)
    q_ref, kv_ref = q0.clone(), kv.clone()
    rope_store_ref(q_ref, ckv, norm_w, 1e-6, cos, sin, kv_ref, slots, True)
    res["rope_store"] = []
    # (tokens a program, warps, interleaved rotary, heads): the last rows tell which part of the work costs
    for block_t, warps, inter, heads in ((1, 4, True, HEADS), (4, 4, True, HEADS), (8, 4, True, HEADS),
                                         (8, 2, True, HEADS), (16, 8, True, HEADS), (8, 4, False, HEADS),
                                         (8, 4, True, 1), (1, 4, True, 1), (1, 4, False, HEADS)):
        q = q0.clone()[:, :heads]
        us = timed(lambda: mla_rope_store(q, ckv, norm_w, 1e-6, cos, sin, kv, slots, inter, block_t=block_t,
                                          num_warps=warps))
        err = float("nan")
        if inter and heads == HEADS:
            q = q0.clone()
            mla_rope_store(q, ckv, norm_w, 1e-6, cos, sin, kv, slots, True, block_t=block_t, num_warps=warps)
            err = max((q.float() - q_ref.float()).abs().max().item(),
                      (kv.float() - kv_ref.float()).abs().max().item())
        res["rope_store"].append({"block_t": block_t, "num_warps": warps, "interleaved": inter, "heads": heads,
                                  "us": us, "max_abs_err": err})
        print(f"mla_rope_store block_t {block_t:2d} warps {warps} interleaved {inter} heads {heads:2d}: {us:8.1f} us"
              f"  (max abs err vs ref {err:.2e})", flush=True)
    q = q0.clone()
    res["rope_store_ref_us"] = timed(lambda: rope_store_ref(q, ckv, norm_w, 1e-6, cos, sin, kv, slots, True))
    res["copy_floor_us"] = timed(lambda: q0.clone())  # 168 MB read + written: a bandwidth yardstick

    # keys, values, attention, output
    latent = torch.randn(t, DL, device=dev, generator=g).to(bf16)
    w = (torch.randn(HEADS * (NOPE + V), DL, device=dev, generator=g) * DL ** -0.5).to(bf16)
    pe = torch.randn(t, DR, device=dev, generator=g).to(bf16)
    q = torch.randn(t, HEADS, NOPE + DR, device=dev, generator=g).to(bf16)
    scale = (NOPE + DR) ** -0.5
    kvx = F.linear(latent, w).view(t, HEADS, NOPE + V)  # kv_b_proj's output
    res["kv_b_proj_us"] = timed(lambda: F.linear(latent, w))

    def cat_keys():
        return torch.cat((kvx[..., :NOPE], pe[:, None, :].expand(t, HEADS, DR)), dim=-1), kvx[..., NOPE:]

    k_old, v_view = expanded_keys(kvx, pe, NOPE)
    k_new, _ = cat_keys()
    res["keys_equal"] = bool(torch.equal(k_old, k_new))
    res["expanded_keys_us"] = timed(lambda: expanded_keys(kvx, pe, NOPE))
    res["cat_keys_us"] = timed(cat_keys)
    res["expanded_keys_kernels"] = kernels(lambda: expanded_keys(kvx, pe, NOPE))
    res["cat_keys_kernels"] = kernels(cat_keys)
    v_contig = v_view.contiguous()
    out_strided = decompressed_attention(q, k_new, v_view, 0, scale)
    out_contig = decompressed_attention(q, k_new, v_contig, 0, scale)
    res["strided_v_equal"] = bool(torch.equal(out_strided, out_contig))
    res["out_is_contiguous"] = bool(out_strided.is_contiguous())
    res["sdpa_strided_v_us"] = timed(lambda: decompressed_attention(q, k_new, v_view, 0, scale))
    res["sdpa_contig_v_us"] = timed(lambda: decompressed_attention(q, k_new, v_contig, 0, scale))
    res["v_contiguous_copy_us"] = timed(lambda: v_view.contiguous())
    res["sdpa_strided_v_kernels"] = kernels(lambda: decompressed_attention(q, k_new, v_view, 0, scale))
    buf = torch.empty(t, HEADS, V, dtype=bf16, device=dev)

    def copy_out():
        buf[0:t] = out_strided

    res["output_copy_us"] = timed(copy_out)
    for key, value in res.items():
        if key != "rope_store":
            print(f"{key}: {value}", flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "glm_mla_prefill_paths.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
