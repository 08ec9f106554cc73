"""GPU checks of Nemotron-H MTP speculation: the Mamba verify path at Nano's real shape, tiny MTP checkpoints end to end, and Nano-shaped verify cost.

1. ``kernel``: ``mamba_verify`` (the fused verify kernel, one launch) against K + 1 chained fused
   decode launches with row copies and against its fp32 reference path at Nemotron-3 Nano's Mamba
   shape (64 heads x 64, state 128, 8 groups, conv 4), K = 1..3, batches 1 / 8 / 33, fp32 and bf16:
   output, every state row and window, other rows untouched, tickets reset; then fused vs chained vs
   one plain decode step, each as 16 layers (own states) in one CUDA graph, and vs its HBM floor.
2. ``tiny``: the tests' tiny MTP checkpoints through ``LLM(..., speculative=True)``: greedy output
   with K = 1..3 (MTP drafts through the verify CUDA graphs and eagerly, oracle drafts eagerly)
   against speculation off (CUDA graphs), fp32 and bf16.
3. ``nano``: Nemotron-3-Nano-shaped random weights (``bench/nemotron_bench.py``'s config) with one
   MTP layer (Super's ``*E``): the K=2 verify step in forced-accept mode against a plain decode step
   (CUDA graphs), and batch-1 / 8-stream tok/s both ways.

One line per figure; ``--out`` writes them, ``$OUT/nemotron_mtp_gpu.json`` gets them too.

    python plugins/nemotron/bench/mtp_gpu_check.py --out mtp_checks.txt          # on the GPU
    python plugins/nemotron/bench/mtp_gpu_check.py --only kernel,tiny             # without the 30B model
    python plugins/nemotron/bench/mtp_gpu_check.py --only kernel --sweep          # + the verify kernel's configs
    TRITON_INTERPRET=1 python plugins/nemotron/bench/mtp_gpu_check.py --device cpu   # smoke run of the driver
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

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

LINES: list[str] = []


def say(line: str) -> None:
    LINES.append(line)
    print(line, flush=True)


def rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()


def _nano_mixer(dtype: torch.dtype, device: str):
    from armillary.hf_config import HFConfig
    from armillary_nemotron.config import NemotronHArgs
    from armillary_nemotron.mamba_mixer import Mamba2Mixer
    from nemotron_bench import nano_config

    tiny = device != "cuda"  # the smoke run: the driver itself at a tiny shape under the interpreter
    args = NemotronHArgs.parse(HFConfig(json.loads(json.dumps(nano_config(tiny)))))  # as read from config.json
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            mixer = Mamba2Mixer(args)
    finally:
        torch.set_default_dtype(default)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in mixer.named_parameters():
            r = torch.randn(p.shape, generator=gen).to(p.device)
            if name == "A_log":
                p.copy_(torch.log(torch.rand(p.shape, generator=gen) * 4 + 0.5))
            elif name == "dt_bias":
                p.copy_(r * 0.5 - 1.0)
            elif name == "norm.weight":
                p.copy_(1 + 0.3 * r)
            else:
                p.copy_(r * 0.3)
    return mixer


def _verify_inputs(mixer, batch: int, k: int, dtype: torch.dtype, seed: int):
    import types

    dev = mixer.A_log.device
    gen = torch.Generator(device=dev).manual_seed(seed)
    slots = torch.arange(batch, device=dev) * 2  # every other slot: the rest must stay untouched
    rows = 2 * batch + torch.arange(batch * k, device=dev).view(batch, k)
    total = 2 * batch + batch * k
    conv = torch.randn(total, mixer.conv_dim, 3, generator=gen, device=dev).to(dtype)
    ssm = torch.randn(total, mixer.heads, mixer.head_dim, mixer.state_size, generator=gen, device=dev)
    width = mixer.d_inner + mixer.conv_dim + mixer.heads
    projected = torch.randn(batch * (k + 1), width, generator=gen, device=dev).to(dtype)
    return types.SimpleNamespace(spec_state_rows=rows, state_slots=slots), conv, ssm, projected


def _time_ms(fn, iters: int = 50) -> float:
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _kernel_args(mixer, projected: torch.Tensor, spec, conv: torch.Tensor, ssm: torch.Tensor) -> dict:
    """``mamba_verify_step`` / ``chained_decode_verify`` keywords for the mixer's parameters and these pools."""
    z, xbc, dt = projected.split([mixer.d_inner, mixer.conv_dim, mixer.heads], dim=-1)
    return dict(xbc=xbc, z=z, dt=dt, conv_weight=mixer.conv1d.weight[:, 0], conv_bias=mixer.conv1d.bias,
                conv_states=conv, A_log=mixer.A_log, D=mixer.D, dt_bias=mixer.dt_bias, dt_min=mixer.dt_min,
                norm_weight=mixer.norm.weight, eps=mixer.norm.eps, ssm_states=ssm, state_slots=spec.state_slots,
                spec_rows=spec.spec_state_rows, heads=mixer.heads, head_dim=mixer.head_dim)


def _graph_us(calls, layers: int) -> float:
    """µs per layer of ``calls`` (one closure per layer, each on its own states) replayed as one CUDA graph."""
    import triton

    for fn in calls:  # outside the capture: compiles, sizes the scratch and ticket buffers
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    us = triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median") * 1e3 / layers
    del graph
    return us


def _sweep_verify(kw: list[dict], batch: int, k: int, layers: int) -> None:
    """The fused verify kernel's launch configs (``split_p`` x ``num_warps``) in CUDA graphs: one line each, then the
    best as a ``mamba_verify`` by_batch table entry (the default is the decode step's entry at this batch)."""
    from armillary_nemotron.ops.mamba.verify import mamba_verify_step, verify_config

    picked = verify_config(batch, 64, 128, kw[0]["xbc"].device)
    results = []
    for split in (0, 8, 16, 32, 64):
        for warps in (1, 2, 4, 8):
            cfg = {"split_p": split, "num_warps": warps}
            us = _graph_us([lambda a=a, c=cfg: mamba_verify_step(**a, config=c) for a in kw], layers)
            results.append((us, cfg))
            say(f"sweep bf16 B={batch} K={k} split_p={split} num_warps={warps}: {us:.1f} us/layer")
    best_us, best = min(results, key=lambda r: r[0])
    now = next((us for us, cfg in results if cfg == {"split_p": picked["split_p"], "num_warps": picked["num_warps"]}),
               float("nan"))  # nan: the current pick lies outside the grid
    say(f"sweep bf16 B={batch} K={k}: best {json.dumps(best)} {best_us:.1f} us/layer vs the current pick "
        f"{json.dumps({'split_p': picked['split_p'], 'num_warps': picked['num_warps']})} {now:.1f} us/layer; table "
        f'entry "mamba_verify": {{"p64_n128": {{"by_batch": {{"{batch}": {json.dumps(best)}}}}}}}')


@torch.inference_mode()
def kernel_checks(device: str, layers: int = 16, sweep: bool = False) -> None:
    from armillary.kernels.triton.device_buffers import ticket_buffer
    from armillary_nemotron.mamba_verify import mamba_verify
    from armillary_nemotron.ops.mamba.decode import mamba_decode_step
    from armillary_nemotron.ops.mamba.verify import chained_decode_verify, mamba_verify_step

    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        mixer = _nano_mixer(dtype, device)
        # fused vs chained decode launches: the same fp32 math, up to one rounding of a bf16 output
        chain_tol = 1e-5 if dtype == torch.float32 else 1e-2
        for batch in (1, 8, 33) if device == "cuda" else (3,):
            for k in (1, 2, 3):
                spec, conv, ssm, projected = _verify_inputs(mixer, batch, k, dtype, seed=batch * 10 + k)
                c_ref, s_ref, c_got, s_got = conv.clone(), ssm.clone(), conv.clone(), ssm.clone()
                c_chain, s_chain = conv.clone(), ssm.clone()
                ref = mamba_verify(mixer, projected, spec, c_ref, s_ref, fast=False)
                got = mamba_verify(mixer, projected, spec, c_got, s_got, fast=True)
                chain = chained_decode_verify(**_kernel_args(mixer, projected, spec, c_chain, s_chain))
                written = torch.cat([spec.spec_state_rows.flatten(), spec.state_slots])
                vs_chain = (rel(got, chain), rel(s_got[written], s_chain[written]))
                windows = torch.equal(c_got, c_chain)
                errs = (rel(got, ref), rel(s_got[written], s_ref[written]), rel(c_got[written], c_ref[written]))
                untouched = torch.arange(1, 2 * batch, 2, device=device)
                kept = torch.equal(s_got[untouched], ssm[untouched]) and torch.equal(c_got[untouched], conv[untouched])
                tickets = not ticket_buffer(torch.device(device), 0).any().item()
                ok = max(errs) < tol and vs_chain[0] < chain_tol and vs_chain[1] < 1e-5 and windows and kept and tickets
                say(f"kernel {str(dtype).removeprefix('torch.')} B={batch} K={k}: fused vs chained decode y "
                    f"{vs_chain[0]:.1e}, ssm rows {vs_chain[1]:.1e}, conv rows equal {windows}; vs fp32 reference y "
                    f"{errs[0]:.1e}, ssm rows {errs[1]:.1e}, conv rows {errs[2]:.1e}; other rows untouched {kept}, "
                    f"tickets reset {tickets} -> {'PASS' if ok else 'FAIL'}")
        if dtype == torch.bfloat16 and device == "cuda":
            for batch, k in ((1, 1), (1, 2), (1, 3), (8, 2), (33, 2)):
                per_layer = [_verify_inputs(mixer, batch, k, dtype, seed=100 + i) for i in range(layers)]
                kw = [_kernel_args(mixer, projected, spec, conv, ssm) for spec, conv, ssm, projected in per_layer]
                fused = _graph_us([lambda a=a: mamba_verify_step(**a) for a in kw], layers)
                chained = _graph_us([lambda a=a: chained_decode_verify(**a) for a in kw], layers)
                one = [{**a, "xbc": a["xbc"][::k + 1], "z": a["z"][::k + 1], "dt": a["dt"][::k + 1]} for a in kw]
                decode = _graph_us([lambda a=a: mamba_decode_step(
                    a["xbc"], a["z"], a["dt"], a["conv_weight"], a["conv_bias"], a["conv_states"], a["A_log"], a["D"],
                    a["dt_bias"], a["dt_min"], a["norm_weight"], a["eps"], a["ssm_states"], a["state_slots"],
                    a["heads"], a["head_dim"]) for a in one], layers)
                eager = _time_ms(lambda: mamba_verify_step(**kw[0])) * 1e3
                # HBM floor of the fused step: the slot's fp32 state read once, K + 1 states and windows written
                state = mixer.heads * mixer.head_dim * mixer.state_size * 4
                window = mixer.conv_dim * 3 * 2
                floor = batch * (state + window + (k + 1) * (state + window)) / 4.8e12 * 1e6
                say(f"time bf16 B={batch} K={k} (CUDA graph, {layers} layers): fused verify {fused:.1f} us/layer, "
                    f"chained decodes + row copies {chained:.1f}, one decode step {decode:.1f}; fused / decode "
                    f"{fused / decode:.2f}, chained / fused {chained / fused:.2f}, fused vs HBM floor {floor:.1f} us "
                    f"({floor / fused:.0%}); fused eager {eager:.1f} us")
                if sweep and k == 2:
                    _sweep_verify(kw, batch, k, layers)
                del per_layer, kw, one
                torch.cuda.empty_cache()
    if device == "cuda":
        torch.cuda.empty_cache()


def tiny_checks(device: str) -> None:
    from armillary import LLM, SamplingParams
    from plugins.nemotron.tests.hf_models import VOCAB, nemotron_registry, prompts
    from plugins.nemotron.tests.mtp_checkpoint import save_with_mtp
    from tests.fixtures.oracle_drafts import OracleProposer, oracle_reference

    def generate(path: Path, dtype: str, oracle: dict | None = None, **kw):
        llm = LLM(str(path), registry=nemotron_registry(), dtype=dtype, device=device, max_model_len=512,
                  max_num_seqs=8, **kw)
        if oracle is not None:
            llm.engine.runner.proposer = OracleProposer(llm.engine.runner.proposer, oracle, VOCAB)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts()],
                            SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
        stats = llm.engine.stats()
        llm.shutdown()
        return [list(o.outputs[0].token_ids) for o in outs], stats

    with tempfile.TemporaryDirectory() as tmp:
        for case, pattern in (("ME*ME_groups2_chunk8", "*E"), ("M*-EM_groups4_router_groups", "E*-")):
            path = save_with_mtp(case, pattern, Path(tmp) / case.replace("*", "x")).model_dir
            for dtype in ("float32", "bfloat16") if device == "cuda" else ("float32",):
                base, _ = generate(path, dtype)
                oracle = oracle_reference(prompts(), base)
                for k in (1, 2, 3) if device == "cuda" else (2,):
                    # the oracle replaces the proposer after start-up, which captured graphs would not see: eager
                    for name, kw in (("mtp graphs", {}), ("mtp eager", {"enforce_eager": True}),
                                     ("oracle eager", {"oracle": oracle, "enforce_eager": True})):
                        got, stats = generate(path, dtype, speculative=True, num_drafts=k, **kw)
                        same = sum(a == b for a, b in zip(got, base))
                        first = min((next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                                     for a, b in zip(got, base)), default=0)
                        say(f"tiny {case}+mtp{pattern} {dtype} K={k} {name}: {same}/{len(base)} identical (first "
                            f"divergence at token {first}), tokens/step {stats['spec_tokens_per_step']:.2f}, "
                            f"accepted {stats['num_accepted_tokens']}")


def _zero_router_bias(model) -> None:
    """Dummy weights make the correction biases dominate the router (``nemotron_bench``): zero them, MTP's too."""
    layers = list(model.backbone.layers) + (list(model.mtp.layers) if model.mtp is not None else [])
    with torch.no_grad():
        for layer in layers:
            if layer.kind == "moe":
                layer.mixer.gate.e_score_correction_bias.zero_()


def nano_checks(prompt: int, new: int, steps: int) -> None:
    from nemotron_bench import nano_config
    from qwen_bench import Ours
    from speculative_bench import _decode_rate, _step_time

    cfg = nano_config(False)
    cfg["num_nextn_predict_layers"] = 1
    cfg["mtp_layers_block_type"] = ["full_attention", "moe"]  # Nemotron-3 Super's "*E"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        (path / "config.json").write_text(json.dumps(cfg))
        spec = Ours(path, "cuda", 4096, 64, eager=False, speculative=True, num_drafts=2)
        _zero_router_bias(spec.engine.model)
        say(f"nano+mtp startup with --speculative: {spec.startup:.1f} s")
        spec.engine.runner.speculative.force_accept = True
        verify = _step_time(spec, prompt, steps)
        say(f"nano+mtp verify step K=2, forced accept: {verify * 1e3:.2f} ms")
        say(f"nano+mtp b1 decode K=2 forced accept: {_decode_rate(spec, 1, prompt, new):.1f} tok/s")
        say(f"nano+mtp 8 streams K=2 forced accept: {_decode_rate(spec, 8, prompt, new):.1f} tok/s")
        spec.llm.shutdown()
        del spec
        gc.collect()
        torch.cuda.empty_cache()
        plain = Ours(path, "cuda", 4096, 64, eager=False)
        _zero_router_bias(plain.engine.model)
        step = _step_time(plain, prompt, steps)
        say(f"nano plain decode step, CUDA graphs: {step * 1e3:.2f} ms; verify / plain {verify / step:.2f} "
            "(issue 12's bar for Qwen: <= 1.25)")
        say(f"nano b1 decode, no speculation: {_decode_rate(plain, 1, prompt, new):.1f} tok/s; projected at 2.5 "
            f"tokens/step with K=2: {2.5 / verify:.1f} tok/s")
        say(f"nano 8 streams, no speculation: {_decode_rate(plain, 8, prompt, new):.1f} tok/s")
        plain.llm.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="kernel,tiny,nano", help="comma-separated: kernel, tiny, nano")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the driver (tiny shapes, no nano)")
    ap.add_argument("--out")
    ap.add_argument("--sweep", action="store_true", help="kernel: also sweep the fused verify launch configs (K=2)")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--steps", type=int, default=64)
    args = ap.parse_args()
    parts = set(args.only.split(","))
    if "kernel" in parts:
        kernel_checks(args.device, sweep=args.sweep)
    if "tiny" in parts:
        tiny_checks(args.device)
    if "nano" in parts and args.device == "cuda":
        nano_checks(args.prompt, args.new, args.steps)
    if args.out:
        Path(args.out).write_text("\n".join(LINES) + "\n")
    out = os.environ.get("OUT")
    if out:
        Path(out, "nemotron_mtp_gpu.json").write_text(json.dumps(LINES, indent=1))


if __name__ == "__main__":
    main()
