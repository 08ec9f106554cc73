"""GLM-4.7-Flash router logits at prefill rows (GPU, real sizes: bf16 x [T, 2048], float32 W [64, 2048]):
``router_logits_mma`` (the weight split into three bf16 parts, tensor-core dots) against the float32 GEMM
transformers runs (``F.linear(x.float(), w)``, TF32 off): relative error, top-4 ids after the sigmoid / bias
routing, and time (CUDA events, median of 5), with a launch-config sweep; prints the best config per T.

    python bench/glm_router_prefill.py [--tokens 2048,16384] [--out DIR]
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grouped_search import median_event_us as timed  # noqa: E402

from armillary.kernels.triton.impls import sigmoid_topk
from armillary_glm_flash.ops import router as router_ops

EXPERTS, HIDDEN, TOPK = 64, 2048, 4


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="65,2048,16384")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference is transformers' float32 GEMM
    results: dict[str, object] = {}
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(EXPERTS, HIDDEN, device="cuda", generator=g) * HIDDEN ** -0.5
    bias = torch.randn(EXPERTS, device="cuda", generator=g) * 0.1
    for tokens in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(tokens, HIDDEN, device="cuda", generator=g).bfloat16()
        want = F.linear(x.float(), w)
        got = router_ops.router_logits_mma(x, w)
        err = ((got - want).norm() / want.norm()).item()
        ids_want = sigmoid_topk(want, bias, TOPK, True, 1.8, 0)[1]
        ids_got = sigmoid_topk(got, bias, TOPK, True, 1.8, 0)[1]
        same = (ids_want.sort(-1).values == ids_got.sort(-1).values).all(-1).float().mean().item()
        torch_us = timed(lambda: F.linear(x.float(), w))
        default_us = timed(lambda: router_ops.router_logits_mma(x, w))
        best = (default_us, router_ops.mma_config(EXPERTS, HIDDEN, tokens, x.device))
        for bt, bk, nw, ns in itertools.product((32, 64, 128), (32, 64, 128), (4, 8), (2, 3, 4)):
            cfg = {"BLOCK_T": bt, "BLOCK_K": bk, "num_warps": nw, "num_stages": ns}
            try:
                out = router_ops.router_logits_mma(x, w, config=cfg)
                if not torch.equal(out, router_ops.router_logits_mma(x, w, config=cfg)):
                    continue
                us = timed(lambda: router_ops.router_logits_mma(x, w, config=cfg))
            except Exception as e:  # over the shared memory
                print(f"  {cfg}: {type(e).__name__}", flush=True)
                continue
            if us < best[0]:
                best = (us, cfg)
        line = (f"T={tokens}: error {err:.2e}, top-{TOPK} ids equal in {same:.4%} of rows; F.linear(x.float()) "
                f"{torch_us:.1f} us, router_logits_mma {default_us:.1f} us (defaults), best {best[0]:.1f} us {best[1]}")
        print(line, flush=True)
        results[f"T{tokens}"] = {"error": err, "ids_equal": same, "torch_us": torch_us, "mma_us": default_us,
                                 "best_us": best[0], "best": best[1]}
    if args.out:
        Path(args.out, "glm_router_prefill.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
