"""The fused verify-step GDN kernel (``fused_gdn_verify``) at the Qwen3.6-35B-A3B GDN shape: checked
against K + 1 chained ``fused_gdn_decode`` launches, then both timed in CUDA graphs.

Shape: H=16 key heads, HV=32 value heads, K=V=128, conv kernel 4, bf16 rows, fp32 states. For each
(batch, drafts): outputs and every position's state row (max |err| / max |ref|), conv windows bitwise,
tickets back at 0; then µs per layer of one launch vs the chain, each as 20 layers (own parameters
and states) in one CUDA graph, L2 cleared before every replay. One line per case; exit 1 on a failure.

    python bench/gdn_verify_check.py            # on the GPU
    python bench/gdn_verify_check.py --smoke    # CPU, TRITON_INTERPRET=1, tiny shape: the logic only
"""
from __future__ import annotations

import os
import sys

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from armillary.kernels.triton.device_buffers import ticket_buffer  # noqa: E402
from armillary_qwen_gdn_moe.ops.gated_delta_rule.fused_recurrent import fused_gdn_decode  # noqa: E402
from armillary_qwen_gdn_moe.ops.gated_delta_rule.fused_verify import fused_gdn_verify  # noqa: E402

DEVICE = torch.device("cpu" if SMOKE else "cuda")
DTYPE = torch.float32 if SMOKE else torch.bfloat16
H, HV, K, V, KW = (2, 4, 16, 24, 4) if SMOKE else (16, 32, 128, 128, 4)
CONV_DIM = 2 * H * K + HV * V
LAYERS = 2 if SMOKE else 20


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()


def layer(batch: int, drafts: int, gen: torch.Generator) -> dict:
    rows = batch * (drafts + 1) + 2
    rnd = lambda *shape, scale=1.0: (torch.randn(*shape, generator=gen) * scale).to(DEVICE)  # noqa: E731
    perm = torch.randperm(rows, generator=gen, device="cpu").to(DEVICE)
    return {
        "mixed": rnd(batch * (drafts + 1), CONV_DIM + HV * V + 2 * HV).to(DTYPE),
        "conv_weight": rnd(CONV_DIM, KW, scale=0.5).to(DTYPE), "A_log": rnd(HV, scale=0.5),
        "dt_bias": rnd(HV, scale=0.5), "norm_weight": rnd(V).to(DTYPE),
        "conv": rnd(rows, CONV_DIM, KW - 1).to(DTYPE), "ssm": rnd(rows, HV, K, V, scale=0.3),
        "slots": perm[:batch].contiguous(), "spec": perm[batch:batch * (drafts + 1)].reshape(batch, drafts).contiguous(),
    }


def fused(p: dict) -> torch.Tensor:
    return fused_gdn_verify(p["mixed"], p["conv_weight"], p["conv"], p["ssm"], p["A_log"], p["dt_bias"],
                            p["norm_weight"], 1e-6, p["slots"], p["spec"], H, K, V)


def chained(p: dict) -> torch.Tensor:
    batch, drafts = p["spec"].shape
    steps = p["mixed"].view(batch, drafts + 1, -1)
    outs = []
    for i in range(drafts + 1):
        src = p["slots"] if i == 0 else p["spec"][:, i - 1].contiguous()
        dst = p["spec"][:, i].contiguous() if i < drafts else p["slots"]
        outs.append(fused_gdn_decode(steps[:, i].contiguous(), p["conv_weight"], p["conv"], p["ssm"], p["A_log"],
                                     p["dt_bias"], p["norm_weight"], 1e-6, src, H, K, V, out_slots=dst))
    return torch.stack(outs, 1).reshape(batch * (drafts + 1), -1)


def check(batch: int, drafts: int) -> bool:
    p = layer(batch, drafts, torch.Generator(device="cpu").manual_seed(batch * 10 + drafts))
    q = {**p, "conv": p["conv"].clone(), "ssm": p["ssm"].clone()}
    out, ref = fused(p), chained(q)
    written = torch.cat([p["spec"].flatten(), p["slots"]])
    errs = (rel_err(out, ref), rel_err(p["ssm"][written], q["ssm"][written]))
    windows = torch.equal(p["conv"], q["conv"])
    tickets = not ticket_buffer(DEVICE, 0).any().item()
    ok = errs[0] < 2e-2 and errs[1] < 1e-4 and windows and tickets
    print(f"B={batch} D={drafts}: outputs {errs[0]:.2e}, states {errs[1]:.2e}, windows equal {windows}, "
          f"tickets reset {tickets} -> {'ok' if ok else 'FAIL'}", flush=True)
    return ok


def timing(batch: int, drafts: int) -> None:
    import triton

    gen = torch.Generator(device="cpu").manual_seed(1)
    layers = [layer(batch, drafts, gen) for _ in range(LAYERS)]
    for name, fn in (("fused", fused), ("chained", chained)):
        for p in layers:
            fn(p)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for p in layers:
                fn(p)
        us = triton.testing.do_bench(graph.replay, warmup=50, rep=300, return_mode="median") * 1e3 / LAYERS
        print(f"  B={batch} D={drafts} {name}: {us:.2f} us per layer", flush=True)


def main() -> None:
    cases = [(1, 1), (2, 2)] if SMOKE else [(1, 1), (1, 2), (1, 3), (4, 2), (8, 2), (32, 2)]
    ok = all([check(b, d) for b, d in cases])
    if not SMOKE:
        for b, d in [(1, 2), (1, 3), (8, 2), (32, 2)]:
            timing(b, d)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
