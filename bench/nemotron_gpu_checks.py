"""GPU correctness checks of the nemotron plugin's fast path (run on the device; one line per check).

1. Tiny configs (every case of the plugin's transformers tests, fp32): greedy tokens of the reference
   kernels, the Triton kernels eagerly and the Triton kernels with CUDA-graph decode all equal
   transformers' tokens (4 prompts up to 100 tokens, 32 steps, batched, 64-token step budget).
2. Kernels at the Nemotron-3-Nano sizes (64 heads x 64, 8 groups, state 128, conv 6144 channels,
   128 experts top-6 relu² at 2688 -> 1856, shared 2 x 1856), fp32 and bf16, against the naive
   references: the varlen SSD scan from and into slot states, serial and chunk-parallel (sequences of
   1, 777 and 2051 tokens, then one of 16384), the prefill's grouped gated norm reading z in place
   (16K rows), the router's fp32 logits kernels (bf16 x, 1 to 16K rows: fp32 accuracy, the top-6
   ids as the fp32 GEMM's), the fused decode step (conv, state update, gated norm) at batch 1 and 64, 3 launches in a
   row at 64 and num_warps 4 and 16 (a failing one adds its max abs errors and the first (batch,
   head) that is off), the sigmoid router with n_group 1 and 8, the relu² fused MoE at 1, 64 and
   2048 tokens. Relative errors must stay under 1e-4 (fp32; the Triton dots use TF32 elsewhere,
   IEEE here) and 2e-2 (bf16).
3. Real layer widths, five layers "MEM*E" (random fp32 weights, the Mamba mixers' conv, norm, A, dt
   bias and D at working scales): 64 greedy decode steps through the
   Triton kernels with CUDA graphs against the reference kernels on the same weights: tokens, and
   the per-step relative logits error while the tokens agree (< 1e-3).
``--sweep`` adds timings of the Mamba kernels' launch configs, serial and chunked scan, and of the
router kernels against ``F.linear(x.float(), W)`` (to fill tuning/sm_90.json).

    python bench/nemotron_gpu_checks.py [--sweep] [--out checks.md]
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from armillary import LLM, SamplingParams  # noqa: E402
from armillary.kernels import moe as moe_ref  # noqa: E402
from armillary.kernels.norm import gated_rms_norm  # noqa: E402
from armillary.kernels import ops  # noqa: E402
from armillary.kernels.triton import moe as tri_moe  # noqa: E402
from armillary.kernels.triton import moe_routing  # noqa: E402
from armillary_nemotron.ops import router as tri_router  # noqa: E402
from armillary_nemotron.ops.mamba import decode as tri_decode  # noqa: E402
from armillary_nemotron.ops.mamba.gated_norm import gated_group_norm  # noqa: E402
from armillary_nemotron.ops.mamba import ssd_scan as tri_scan  # noqa: E402
from armillary_nemotron.ops.mamba.naive import (  # noqa: E402
    causal_conv1d_update_ref,
    selective_state_update_ref,
    ssd_chunk_scan_ref,
)
from plugins.nemotron.tests.hf_models import CASES, make_reference, nemotron_registry  # noqa: E402

GREEDY = dict(temperature=0.0, ignore_eos=True)
SCAN_PATHS = {"serial": {"chunked_min_tokens": 1 << 30}, "chunked": {"chunked_min_tokens": 0}}
H, P, G, N, HIDDEN, E, K, INTER = 64, 64, 8, 128, 2688, 128, 6, 1856
DEV = "cuda"


def _release() -> None:
    gc.collect()
    if DEV == "cuda":
        torch.cuda.empty_cache()


def rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def tiny_checks(lines: list[str]) -> None:
    for case in CASES:
        ref = make_reference(case, Path(tempfile.mkdtemp()))
        prompts = [{"prompt_token_ids": p} for p in ref.prompts]
        ok = {}
        for label, kw in (("reference", dict(kernel_backend="reference")), ("triton eager", dict(enforce_eager=True)),
                          ("triton + graphs", {})):
            llm = LLM(str(ref.model_dir), registry=nemotron_registry(), dtype="float32", device=DEV,
                      max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, **kw)
            outs = llm.generate(prompts, SamplingParams(max_tokens=len(ref.tokens[0]), **GREEDY))
            ok[label] = [o.outputs[0].token_ids for o in outs] == ref.tokens
            if label.endswith("graphs"):
                graphs = llm.engine.runner.graphs
                ok["graphs captured"] = graphs is not None and bool(graphs.graphs)
            del llm
            _release()
        ops.set_backend("auto")
        lines.append(f"tiny {case.name}: tokens equal transformers: {ok}")


def _mamba_inputs(total: int, slots: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    xbc = torch.randn(total, H * P + 2 * G * N, device=DEV, generator=gen).to(dtype)
    dt = (torch.randn(total, H, device=DEV, generator=gen) * 0.5 - 1.0).to(dtype)
    A = -torch.rand(H, device=DEV, generator=gen) * 4 - 0.1
    D = torch.randn(H, device=DEV, generator=gen)
    dt_bias = torch.randn(H, device=DEV, generator=gen) * 0.5
    states = torch.randn(slots, H, P, N, device=DEV, generator=gen) * 0.3
    x, B, C = xbc.split([H * P, G * N, G * N], dim=-1)
    return xbc, x, B, C, dt, A, D, dt_bias, states


def _where_bad(got: torch.Tensor, ref: torch.Tensor, tol: float) -> str:
    """got, ref [B, H, ...]: the max abs error, how many (batch, head) rows are off and the first of them."""
    diff = got.float() - ref.float()
    per = diff.flatten(2).norm(dim=-1) / ref.float().flatten(2).norm(dim=-1).clamp_min(1e-30)  # [B, H]
    bad = (per > tol).nonzero().tolist()
    first = f"first (batch, head) {tuple(bad[0])} rel {per[bad[0][0], bad[0][1]].item():.1e}" if bad else "none"
    return f"max abs {diff.abs().max().item():.1e}, bad (batch, head) {len(bad)}/{per.numel()}, {first}"


def decode_check(lines: list[str], dtype: torch.dtype, tol: float, batch: int, steps: int, warps: int | None) -> None:
    """``steps`` fused decode launches in a row on the same pools (the batch's slot order shuffled each
    step) against the references; the last step's out and states are located per (batch, head)."""
    name = str(dtype).removeprefix("torch.")
    gen = torch.Generator(device=DEV).manual_seed(7)
    conv_dim = H * P + 2 * G * N
    w = torch.randn(conv_dim, 4, device=DEV, generator=gen).to(dtype)
    bias = torch.randn(conv_dim, device=DEV, generator=gen).to(dtype)
    conv = torch.randn(batch + 3, conv_dim, 3, device=DEV, generator=gen).to(dtype)
    norm_w = torch.randn(H * P, device=DEV, generator=gen).to(dtype)
    states = _mamba_inputs(1, batch + 3, dtype, batch)[-1]
    c_ref, c_tri, pool_ref, pool_tri = conv.clone(), conv.clone(), states.clone(), states.clone()
    live = torch.randperm(batch + 3, device=DEV, generator=gen)[:batch]
    config = {"num_warps": warps} if warps else None
    for step in range(steps):
        slots = live[torch.randperm(batch, device=DEV, generator=gen)]
        xbc, _, _, _, dt, A, D, dt_bias, _ = _mamba_inputs(batch, 1, dtype, batch + 100 * step)
        z = torch.randn(batch, H * P, device=DEV, generator=gen).to(dtype)
        act = causal_conv1d_update_ref(xbc, w, bias, c_ref, slots)
        xa, Ba, Ca = act.split([H * P, G * N, G * N], dim=-1)
        y = selective_state_update_ref(xa.reshape(batch, H, P), dt, A, Ba.reshape(batch, G, N),
                                       Ca.reshape(batch, G, N), D, dt_bias, 1e-3, pool_ref, slots)
        ref = gated_rms_norm(y.reshape(batch, H * P), z, norm_w, 1e-5, group_size=H * P // G, norm_before_gate=False)
        got = tri_decode.mamba_decode_step(xbc, z, dt, w, bias, c_tri, torch.log(-A), D, dt_bias, 1e-3, norm_w, 1e-5,
                                           pool_tri, slots, H, P, config=config)
    if DEV == "cuda":
        torch.cuda.synchronize()
    errs = (rel(got, ref), rel(c_tri, c_ref), rel(pool_tri, pool_ref))
    verdict = "ok" if max(errs) < tol else "FAIL"
    label = f"fused decode step {name} batch {batch}" + (f", {steps} steps" if steps > 1 else "") + \
        (f", num_warps {warps}" if warps else "")
    lines.append(f"{label}: rel err out {errs[0]:.1e}, window {errs[1]:.1e} (max abs "
                 f"{(c_tri.float() - c_ref.float()).abs().max().item():.1e}), states {errs[2]:.1e}: {verdict}")
    if verdict != "ok":
        lines.append(f"  out: {_where_bad(got.reshape(batch, H, P), ref.reshape(batch, H, P), tol)}")
        lines.append(f"  states: {_where_bad(pool_tri[slots], pool_ref[slots], tol)}")


def scan_check(lines: list[str], name: str, tol: float, lengths: list[int]) -> None:
    """Both scan paths against the reference on the same packed sequences and slot states."""
    dtype = getattr(torch, name)
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    cu = torch.tensor(bounds, dtype=torch.int32, device=DEV)
    _, x, B, C, dt, A, D, dt_bias, states = _mamba_inputs(bounds[-1], 5, dtype, 1)
    slots = torch.tensor([4, 0, 2][: len(lengths)], device=DEV)
    pool_ref = states.clone()
    y_ref = ssd_chunk_scan_ref(x.reshape(-1, H, P), dt, A, B.reshape(-1, G, N), C.reshape(-1, G, N), D, dt_bias,
                               1e-3, 128, cu.tolist(), pool_ref, slots)
    for path, cfg in SCAN_PATHS.items():
        pool_tri = states.clone()
        y = tri_scan.ssd_chunk_scan(x, B, C, dt, torch.log(-A), D, dt_bias, 1e-3, cu, pool_tri, slots, H, P,
                                    config=cfg)
        e1, e2 = rel(y.reshape(-1, H, P), y_ref), rel(pool_tri, pool_ref)
        lines.append(f"ssd scan {path} {name} lengths {lengths}: rel err y {e1:.1e}, states {e2:.1e}: "
                     f"{'ok' if max(e1, e2) < tol else 'FAIL'}")


def gated_norm_check(lines: list[str], dtype: torch.dtype, tol: float) -> None:
    """The prefill's grouped gated norm, z a column view of an in_proj-wide output, against core's reference."""
    rows = 16384 if DEV == "cuda" else 9
    gen = torch.Generator(device=DEV).manual_seed(2)
    projected = torch.randn(rows, 2 * H * P + 2 * G * N + H, device=DEV, generator=gen).to(dtype)
    z, y = projected[:, : H * P], torch.randn(rows, H * P, device=DEV, generator=gen).to(dtype)
    w = (1 + 0.3 * torch.randn(H * P, device=DEV, generator=gen)).to(dtype)
    ref = gated_rms_norm(y.float(), z.float(), w.float(), 1e-5, group_size=H * P // G, norm_before_gate=False)
    err = rel(gated_group_norm(y, z, w, 1e-5, H * P // G), ref)
    lines.append(f"gated group norm {str(dtype).removeprefix('torch.')} {rows} rows (z in place): rel err {err:.1e}: "
                 f"{'ok' if err < tol else 'FAIL'}")


def router_logits_check(lines: list[str]) -> None:
    """bf16 x, fp32 W [E, HIDDEN]: fp32 accuracy at every row count, and the same top-K ids as the fp32 GEMM."""
    gen = torch.Generator(device=DEV).manual_seed(4)
    weight = torch.randn(E, HIDDEN, device=DEV, generator=gen) * 0.02
    for rows in (1, 3, 8, 64, 16384) if DEV == "cuda" else (1, 3, 8):  # the interpreter's bf16 tl.dot is inexact
        x = torch.randn(rows, HIDDEN, device=DEV, generator=gen).to(torch.bfloat16)
        ref = torch.nn.functional.linear(x.double(), weight.double()).float()
        got = tri_router.router_logits(x, weight)
        fp32 = torch.nn.functional.linear(x.float(), weight)
        err, err_fp32 = rel(got, ref), rel(fp32, ref)
        same = (got.topk(K, dim=-1).indices.sort(-1).values == fp32.topk(K, dim=-1).indices.sort(-1).values)
        diff_rows = int((~same.all(-1)).sum())
        lines.append(f"router logits bf16 x {rows} rows: rel err {err:.1e} (fp32 GEMM {err_fp32:.1e}), rows whose "
                     f"top-{K} ids differ from the fp32 GEMM's {diff_rows}: {'ok' if err < 1e-6 else 'FAIL'}")


def kernel_checks(lines: list[str]) -> None:
    router_logits_check(lines)
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        name = str(dtype).removeprefix("torch.")
        for lengths in ([1, 777, 2051], [16384]) if DEV == "cuda" else ([1, 37, 20],):
            scan_check(lines, name, tol, lengths)
        gated_norm_check(lines, dtype, tol)
        for batch, steps, warps in ((1, 1, None), (64, 1, None), (64, 3, None), (64, 1, 4), (64, 1, 16)):
            decode_check(lines, dtype, tol, batch, steps, warps)
    gen = torch.Generator(device=DEV).manual_seed(3)
    logits = torch.randn(777, E, device=DEV, generator=gen)
    bias = torch.randn(E, device=DEV, generator=gen) * 0.1
    for n_group, topk_group in ((1, 1), (8, 4)):
        w_ref, i_ref = moe_ref.sigmoid_topk(logits, bias, K, True, 2.5, n_group, topk_group)
        w, i = moe_routing.topk_sigmoid_bias(logits, bias, K, True, 2.5, 2, n_group=n_group, topk_group=topk_group)
        same = torch.equal(i[:, :K].long().sort(-1).values, i_ref.sort(-1).values)
        werr = rel(w[:, :K].sort(-1).values, w_ref.sort(-1).values)
        lines.append(f"router n_group {n_group} top {topk_group}: ids equal {same}, weights rel err {werr:.1e}: "
                     f"{'ok' if same and werr < 1e-6 else 'FAIL'}")
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        w13 = (torch.randn(E + 2, INTER, HIDDEN, device=DEV, generator=gen) * 0.02).to(dtype)
        w2 = (torch.randn(E + 2, HIDDEN, INTER, device=DEV, generator=gen) * 0.02).to(dtype)
        for tokens in (1, 64, 2048) if DEV == "cuda" else (1, 9):
            x = torch.randn(tokens, HIDDEN, device=DEV, generator=gen).to(dtype)
            weights, ids = moe_routing.topk_sigmoid_bias(torch.randn(tokens, E, device=DEV, generator=gen), bias,
                                                         K, True, 2.5, 2)
            ref = moe_ref.fused_moe(x.float(), w13.float(), w2.float(), weights, ids.long(), "relu2")
            got = tri_moe.fused_moe(x, w13, w2, weights, ids, "relu2")
            err = rel(got, ref)
            lines.append(f"relu² fused MoE {str(dtype).removeprefix('torch.')} {tokens} tokens: rel err {err:.1e}: "
                         f"{'ok' if err < tol else 'FAIL'}")
        del w13, w2
        _release()


def real_width_config() -> dict:
    from nemotron_bench import nano_config

    d = nano_config(False)
    d["layers_block_type"] = ["linear_attention", "moe", "linear_attention", "full_attention", "moe"]
    d.pop("hybrid_override_pattern", None)
    return d


def _mamba_working_scales(layer: torch.nn.Module, gen: torch.Generator) -> None:
    """Dummy weights (uniform ±0.02) leave a Mamba mixer's conv taps a few percent of its conv bias and
    its output small in the residual stream: Mamba-like scales instead, so a wrong decode step shows."""
    m = layer.mixer
    for p, value in ((m.conv1d.weight, torch.randn(m.conv1d.weight.shape, generator=gen) * 0.3),
                     (m.norm.weight, 1 + 0.1 * torch.randn(m.norm.weight.shape, generator=gen)),
                     (m.A_log, torch.log(torch.rand(m.A_log.shape, generator=gen) * 15 + 1)),
                     (m.dt_bias, torch.randn(m.dt_bias.shape, generator=gen) * 0.5 - 2.0),
                     (m.D, 1 + 0.1 * torch.randn(m.D.shape, generator=gen))):
        p.copy_(value.to(p.dtype))


def _decode(llm: LLM, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    rows: list[torch.Tensor] = []
    model = llm.engine.model
    gen = torch.Generator().manual_seed(11)  # the same weights in both runs
    with torch.no_grad():
        for layer in model.backbone.layers:
            if layer.kind == "moe":
                layer.mixer.gate.e_score_correction_bias.zero_()  # dummy biases would pick the same experts
            elif layer.kind == "mamba":
                _mamba_working_scales(layer, gen)
    inner = model.compute_logits

    def record(h: torch.Tensor) -> torch.Tensor:
        out = inner(h)
        rows.append(out.float().cpu())
        return out

    model.compute_logits = record
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=steps, **GREEDY))[0]
    return out.outputs[0].token_ids, rows


def real_width_checks(lines: list[str]) -> None:
    d = Path(tempfile.mkdtemp())
    (d / "config.json").write_text(json.dumps(real_width_config()))
    prompt = torch.randint(10, 131072, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    got = {}
    for label, kw in (("fast", {}), ("reference", dict(kernel_backend="reference", enforce_eager=True))):
        llm = LLM(str(d), registry=nemotron_registry(), load_format="dummy", dtype="float32", device=DEV,
                  max_model_len=1024, max_num_seqs=4, num_kv_blocks=128, **kw)
        got[label] = _decode(llm, prompt, 64)
        del llm
        _release()
    ops.set_backend("auto")
    (fast_tokens, fast_rows), (ref_tokens, ref_rows) = got["fast"], got["reference"]
    agree = next((i for i, (a, b) in enumerate(zip(fast_tokens, ref_tokens)) if a != b), len(ref_tokens))
    worst = max(rel(a, b) for a, b in zip(fast_rows[: agree + 1], ref_rows[: agree + 1]))
    lines.append(f"real widths MEM*E fp32, 64 steps with CUDA graphs: tokens agree for {agree}/64, worst logits "
                 f"rel err {worst:.1e}: {'ok' if agree == 64 and worst < 1e-3 else 'CHECK'}")


def sweep(lines: list[str]) -> None:
    from triton.testing import do_bench

    total = 16384
    cu = torch.tensor([0, total], dtype=torch.int32, device=DEV)
    _, x, B, C, dt, A, D, dt_bias, states = _mamba_inputs(total, 2, torch.bfloat16, 5)
    A_log = torch.log(-A)
    slots = torch.tensor([1], device=DEV)
    for path, pass_ps in (("serial", (16,)), ("chunked", (8, 16, 32))):
        for chunk in (32, 64, 128):
            for block_p in (16, 32, 64):
                for warps in (4, 8):
                    for pass_p in pass_ps:
                        cfg = {"CHUNK": chunk, "BLOCK_P": block_p, "num_warps": warps, "num_stages": 1,
                               "PASS_P": pass_p, **SCAN_PATHS[path]}
                        try:
                            ms = do_bench(lambda: tri_scan.ssd_chunk_scan(x, B, C, dt, A_log, D, dt_bias, 1e-3, cu,
                                                                          states, slots, H, P, config=cfg))
                            lines.append(f"sweep ssd scan {path} 16K {cfg}: {ms * 1e3:.0f} us")
                        except Exception as exc:  # a config that does not fit in registers / shared memory
                            lines.append(f"sweep ssd scan {path} 16K {cfg}: {type(exc).__name__}")
    weight = torch.randn(E, HIDDEN, device=DEV) * 0.02
    for rows in (1, 8, 64, 16384):
        xr = torch.randn(rows, HIDDEN, device=DEV).to(torch.bfloat16)
        ours = do_bench(lambda: tri_router.router_logits(xr, weight)) * 1e3
        cublas = do_bench(lambda: torch.nn.functional.linear(xr.float(), weight)) * 1e3
        lines.append(f"sweep router logits {rows} rows: {ours:.1f} us (F.linear(x.float()) {cublas:.1f} us)")
    for batch in (1, 8, 64):
        xbc, x, B, C, dt, A, D, dt_bias, states = _mamba_inputs(batch, batch, torch.bfloat16, batch)
        A_log = torch.log(-A)
        w = torch.randn(xbc.shape[1], 4, device=DEV).to(torch.bfloat16)
        conv = torch.zeros(batch, xbc.shape[1], 3, device=DEV, dtype=torch.bfloat16)
        z, norm_w = torch.randn(batch, H * P, device=DEV).to(torch.bfloat16), torch.ones(H * P, device=DEV)
        slots = torch.arange(batch, device=DEV)
        for warps in (2, 4, 8, 16):
            us = do_bench(lambda: tri_decode.mamba_decode_step(xbc, z, dt, w, None, conv, A_log, D, dt_bias, 1e-3,
                                                               norm_w, 1e-5, states, slots, H, P,
                                                               config={"num_warps": warps})) * 1e3
            lines.append(f"sweep fused decode step batch {batch} num_warps {warps}: {us:.1f} us")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU, interpreter, small sizes: checks the driver only")
    ap.add_argument("--only", default=None, help="comma-separated: kernel, tiny, real_width, sweep")
    args = ap.parse_args()
    lines: list[str] = []
    checks = (kernel_checks, tiny_checks, real_width_checks) + ((sweep,) if args.sweep else ())
    if args.only:
        wanted = {f"{name}_checks" if name != "sweep" else name for name in args.only.split(",")}
        checks = tuple(check for check in (kernel_checks, tiny_checks, real_width_checks, sweep) if check.__name__ in wanted)
    if args.smoke:
        global DEV, H, P, G, N, HIDDEN, E, K, INTER
        DEV, H, P, G, N, HIDDEN, E, K, INTER = "cpu", 4, 16, 2, 16, 64, 16, 2, 32
        checks = (kernel_checks,)
    for check in checks:
        done = len(lines)
        try:
            check(lines)
        except Exception as exc:  # report and go on: one broken check must not hide the others
            lines.append(f"{check.__name__}: ERROR {type(exc).__name__}: {exc}")
        print("\n".join(lines[done:]), flush=True)  # as each check ends: a run cut short keeps what it saw
    text = "\n".join(lines)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "nemotron_gpu_checks.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
