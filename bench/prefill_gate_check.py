"""The cuDNN fresh-prefill attention with Qwen's sigmoid output gate at the real head sizes (GPU): the fused
path (``sdpa_prefill.fresh_prefill``: SDPA's own output when one prompt fills the step, the gate in one Triton
pass) against the unfused torch ops it replaced (the output copied into the step's buffer, then
``out * torch.sigmoid(gate)``): equal bytes counted, µs of each (CUDA events, median of 5).

    python bench/prefill_gate_check.py [--tokens 16384] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grouped_search import median_event_us as timed  # noqa: E402

from armillary.forward_batch import KVCache
from armillary.kernels import sdpa_prefill

HEADS, KV_HEADS, DIM, PAGE = 16, 2, 256, 16  # Qwen3.6-35B-A3B's full-attention layers


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    t, dev, bf16 = args.tokens, "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    blocks = -(-t // PAGE)
    cache = KVCache(torch.randn(blocks, PAGE, KV_HEADS, DIM, device=dev, generator=g).to(bf16),
                    torch.randn(blocks, PAGE, KV_HEADS, DIM, device=dev, generator=g).to(bf16))
    table = torch.randperm(blocks, device=dev, generator=g).to(torch.int32)[None]  # [1, blocks]
    proj = torch.randn(t, HEADS, 2 * DIM, device=dev, generator=g).to(bf16)  # per head [query | gate]
    q, gate = proj[..., :DIM].contiguous(), proj[..., DIM:]
    batch = SimpleNamespace(block_tables_of=lambda c: table, query_start_loc_cpu=[0, t])
    scale = DIM ** -0.5

    def unfused() -> torch.Tensor:
        k, v = sdpa_prefill.gather_kv(cache, table[0], t)
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           is_causal=True, scale=scale, enable_gqa=True)
        out = q.new_empty(t, HEADS, DIM)
        out[:] = o[0].transpose(0, 1)
        return out * torch.sigmoid(gate)

    def fused() -> torch.Tensor:
        return sdpa_prefill.fresh_prefill(q, cache, batch, scale, None, None, gate)

    want, got = unfused(), fused()
    res = {"tokens": t, "device": torch.cuda.get_device_name(),
           "equal_fraction": (got == want).float().mean().item(),
           "max_abs_diff": (got.float() - want.float()).abs().max().item(),
           "rel_err": ((got.float() - want.float()).norm() / want.float().norm()).item(),
           "unfused_us": timed(unfused), "fused_us": timed(fused)}
    res["ok"] = res["rel_err"] < 1e-3
    for key, value in res.items():
        print(f"{key}: {value}", flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "prefill_gate_check.json").write_text(json.dumps(res, indent=1))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
