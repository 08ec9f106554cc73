"""GLM-4.7-Flash GPU checks: the absorbed MLA decode kernel at the real sizes against the float32 decompressed
reference, its bandwidth inside a CUDA graph, an optional launch-config sweep, the decode step's other MLA /
router kernels (q through W_UK fused with the rope store, split combine + W_UV, router logits, q_a_layernorm in
the q_b GEMV, the one-launch router) against their
references and timed against the torch / cuBLAS ops they replace, and 2 real-shape layers through the fast
path against the reference kernels (prints one line per check; JSON to $OUT if set).

    python bench/glm_flash_gpu_checks.py            # checks + timings
    python bench/glm_flash_gpu_checks.py --sweep    # also sweep BLOCK_H / BLOCK_N / warps / stages per batch
    python bench/glm_flash_gpu_checks.py --folds    # only the folded launches (norm_gemv, router_topk); --sweep too
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from armillary_glm_flash.ops.mla.decode import DEFAULTS, decode_config, mla_decode
from armillary_glm_flash.ops.mla.naive import absorb_query, expand_values, mla_decompressed_ref, write_latent
from glm_flash_kernel_checks import check_fold_kernels, check_step_kernels, time_fold_kernels, time_step_kernels

HEADS, DL, DR, NOPE, V, PAGE = 20, 512, 64, 192, 256, 16
RESULTS: dict[str, object] = {}
TIE_MARGIN = 0.02  # nats: below one bf16 ulp of a logit in [2, 4), where greedy picks are a coin toss


def report(name: str, ok: bool | None, detail: str, **values: object) -> None:
    status = "" if ok is None else ("PASS " if ok else "FAIL ")
    print(f"{status}{name}: {detail}", flush=True)
    RESULTS[name] = {"ok": ok, "detail": detail, **values}


def paged(seq_lens: list[int], dtype: torch.dtype, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    batch, blocks = len(seq_lens), -(-max(seq_lens) // PAGE)
    kv = torch.zeros(batch * blocks + 1, PAGE, DL + DR, dtype=dtype, device="cuda")
    tables = (torch.randperm(batch * blocks, device="cuda", generator=g) + 1).view(batch, blocks).to(torch.int32)
    lat, pe = [], []
    for b, n in enumerate(seq_lens):
        lat.append(torch.randn(n, DL, device="cuda", generator=g).to(dtype))
        pe.append(torch.randn(n, DR, device="cuda", generator=g).to(dtype))
        pos = torch.arange(n, device="cuda")
        write_latent(kv, lat[-1], pe[-1], tables[b, pos // PAGE].long() * PAGE + pos % PAGE)
    q_nope = torch.randn(batch, HEADS, NOPE, device="cuda", generator=g).to(dtype)
    q_pe = torch.randn(batch, HEADS, DR, device="cuda", generator=g).to(dtype)
    w = (torch.randn(HEADS * (NOPE + V), DL, device="cuda", generator=g) * DL ** -0.5).to(dtype)
    return kv, tables, lat, pe, q_nope, q_pe, w


def check_kernel() -> None:
    scale = (NOPE + DR) ** -0.5
    for seq_lens in ([1], [1000], [3, 4097, 16384], [513] * 64):
        kv, tables, lat, pe, q_nope, q_pe, w = paged(seq_lens, torch.bfloat16)
        wh = w.view(HEADS, NOPE + V, DL)
        q_lat = absorb_query(q_nope, wh[:, :NOPE])
        lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
        got = expand_values(mla_decode(q_lat, q_pe, kv, tables, lens, scale, max(seq_lens)), wh[:, NOPE:]).float()
        want = torch.stack([mla_decompressed_ref(q_nope[b:b + 1].float(), q_pe[b:b + 1].float(), lat[b].float(),
                                                 pe[b].float(), w.float(), scale)[0] for b in range(len(seq_lens))])
        err = ((got - want).abs().max() / want.abs().max()).item()
        name = f"mla_decode bf16 B={len(seq_lens)} max_len={max(seq_lens)}"
        report(name, err < 2e-2, f"relative error {err:.2e} vs the fp32 decompressed reference", error=err)


def time_graph(fn, iters: int = 50) -> float:
    """Seconds per call of ``fn`` replayed from a CUDA graph."""
    fn()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def time_kernel(sweep: bool) -> None:
    scale = (NOPE + DR) ** -0.5
    picks = {}
    for batch, ctx in ((1, 1024), (1, 16384), (8, 4096), (64, 1024), (64, 4096)):
        seq_lens = [ctx] * batch
        kv, tables, _, _, q_nope, q_pe, w = paged(seq_lens, torch.bfloat16)
        q_lat = absorb_query(q_nope, w.view(HEADS, NOPE + V, DL)[:, :NOPE]).contiguous()
        lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
        nbytes = batch * ctx * (DL + DR) * 2
        configs = [dict(decode_config(HEADS, DL, DR, q_lat.device))]
        if sweep:
            configs += [dict(DEFAULTS, BLOCK_H=h, BLOCK_N=n, num_warps=wp, num_stages=st)
                        for h, n, wp, st in itertools.product((16, 32), (16, 32, 64), (4, 8), (1, 2, 3))]
        best = None
        for cfg in configs:
            try:
                dt = time_graph(lambda: mla_decode(q_lat, q_pe, kv, tables, lens, scale, 16384 + 512, config=cfg))
            except Exception as exc:  # a config that does not fit (shared memory, registers)
                print(f"  config {cfg} failed: {type(exc).__name__}", flush=True)
                continue
            if best is None or dt < best[0]:
                best = (dt, cfg)
        dt, cfg = best
        picks[f"b{batch}_ctx{ctx}"] = cfg
        report(f"mla_decode time B={batch} ctx={ctx}", None,
               f"{dt * 1e6:.1f} us, {nbytes / dt / 1e9:.0f} GB/s of latents{' (best of sweep)' if sweep else ''}",
               seconds=dt, config=cfg)
    if sweep:
        print("tuning candidates (mla_decode):", json.dumps(picks), flush=True)


def check_layers(prompt_lens: tuple[int, ...] = (7, 300, 1500, 40, 900, 2000)) -> None:
    """Two real-shape layers (dense, MoE) through the Triton kernels vs the reference kernels, bf16. Greedy streams
    part at the first near-tie and differ after it, so each prompt reports where it parted and the reference's top-2
    margin there: it passes when every stream is equal or parts at a tie (margin < ``TIE_MARGIN``), and the
    prefill's first-token logprobs agree."""
    from transformers import Glm4MoeLiteConfig

    from armillary import LLM, SamplingParams
    from armillary.kernels import ops

    cfg = Glm4MoeLiteConfig(num_hidden_layers=2).to_dict()
    cfg.update(architectures=["Glm4MoeLiteForCausalLM"], dtype="bfloat16", vocab_size=8192)
    prompts = [torch.randint(10, 8000, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in prompt_lens]
    outs = {}
    with tempfile.TemporaryDirectory() as d:
        Path(d, "config.json").write_text(json.dumps(cfg))
        for backend in ("reference", "triton"):
            llm = LLM(d, load_format="dummy", dtype="bfloat16", max_model_len=4096, max_num_batched_tokens=1024,
                      kernel_backend=backend, enforce_eager=backend == "reference", gpu_memory_utilization=0.5)
            res = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2))
            outs[backend] = [o.outputs[0] for o in res]
            del llm
            ops.set_backend("auto")
            torch.cuda.empty_cache()
    same = total = 0
    parted, first_dev = [], 0.0
    for ref, tri in zip(outs["reference"], outs["triton"]):
        total += len(ref.token_ids)
        same += sum(a == b for a, b in zip(ref.token_ids, tri.token_ids))
        first_dev = max(first_dev, abs(ref.logprobs[0].logprob - tri.logprobs[0].logprob))
        i = next((i for i, (a, b) in enumerate(zip(ref.token_ids, tri.token_ids)) if a != b), None)
        if i is not None:
            top = ref.logprobs[i].top
            margin = top[0][1] - top[1][1] if len(top) > 1 else float("inf")
            parted.append((i, margin, [t for t, _ in top], [t for t, _ in tri.logprobs[i].top]))
    # a parting is a tie when the reference's top two are closer than bf16 logits resolve (an ulp is 2^-7 · |logit|)
    ties = all(margin < TIE_MARGIN for _, margin, _, _ in parted)
    detail = (f"{same}/{total} greedy tokens equal; first token's logprob |diff| max {first_dev:.2e}; parted at "
              + (", ".join(f"step {i} (reference top-2 {r} margin {m:.4f}, triton's top-2 {t})"
                           for i, m, r, t in parted) or "none"))
    report("2 real-shape layers, triton (CUDA graphs) vs reference", (same == total or ties) and first_dev < 0.05,
           detail, same=same, total=total, parted=parted, first_logprob_diff=first_dev)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--folds", action="store_true", help="only the folded launches' checks and timings")
    args = ap.parse_args()
    t = time.perf_counter()
    if not args.folds:
        check_kernel()
        time_kernel(args.sweep)
        check_step_kernels(paged, report)
        time_step_kernels(paged, report, time_graph, args.sweep)
    check_fold_kernels(report)
    time_fold_kernels(report, time_graph, args.sweep)
    if not args.folds:
        check_layers()
    print(f"done in {time.perf_counter() - t:.0f} s", flush=True)
    out = os.environ.get("OUT")
    if out:
        Path(out, "glm_flash_gpu_checks.json").write_text(json.dumps(RESULTS, indent=1, default=str))


if __name__ == "__main__":
    main()
