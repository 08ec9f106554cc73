"""GEMV MoE kernels (moe_gemv) against the decode and grouped paths at 1-8 tokens, in CUDA graphs without L2 reuse.

    python bench/moe_gemv.py --out DIR            # H200: <= 90 s, writes DIR/moe_gemv.json
    python bench/moe_gemv.py --out DIR --model nemotron   # that plugin's expert shape (nemotron|glm|gemma4)
    python bench/moe_gemv.py --out DIR --model all        # each plugin model in its own process, DIR/<model>/
    python bench/moe_gemv.py --out DIR --smoke    # CPU (TRITON_INTERPRET=1), tiny shapes: logic only

Default (``--model qwen``) Qwen3.6-35B-A3B shapes: H 2048, I 512, bf16, E = 257 (256 routed + the
shared expert fused as the last id), top-8 + 1 = 9 pairs per token. Other models take their
``FusedMoE`` shape from decode_shapes.py (the bench configs): Nemotron-3 Nano relu² non-gated
H 2688, I 1856, 128 routed top-6 + 2 shared; GLM-4.7-Flash silu H 2048, I 1536, 64 top-4 + 1;
Gemma-4-26B-A4B gelu-tanh H 2816, I 704, 128 top-8 (Gemma 3 is dense: nothing to sweep).
Every timed graph runs ROTATE MoE calls, each on its own
copy of all expert weights (the shared expert too), so no call finds weights in L2 (like
consecutive layers). µs are per call; TB/s count the distinct experts' bytes of a call. Per token count:

1. up kernel alone, every UP candidate (TB/s over w13 bytes); h checked against torch;
2. down kernel alone (top-k sum fused), every DOWN candidate (TB/s over w2 bytes); checked likewise;
3. the whole MoE, fused_moe(path="gemv"), the best TOP up x down configs, with and without PDL,
   against path="decode" and path="grouped" with the shipped tables; errors are max|err| / max|ref|
   against the decode path and against a float32 torch reference.

Prints the best config per token count, the crossover (largest T up to which GEMV wins) and the
"fused_moe_gemv" entry for the model plugin's tuning/sm_90.json. Candidates are compiled in worker processes
first (Triton's disk cache); a config that fails to compile or launch is reported and skipped.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))

from armillary.kernels.triton.moe import _ACTIVATIONS, fused_moe, gemv_config_key  # noqa: E402
from armillary.kernels import tuning  # noqa: E402
from armillary.kernels.triton.moe_gemv import gdc_wait, gemv_down, gemv_up  # noqa: E402
from moe_kernels import bench_ms  # noqa: E402


def _argv_model() -> str:
    """--model from the command line (also in the spawned compile workers, which see the parent's argv)."""
    for i, arg in enumerate(sys.argv):
        if arg.startswith("--model="):
            return arg.split("=", 1)[1]
        if arg == "--model" and i + 1 < len(sys.argv):
            return sys.argv[i + 1]
    return "qwen"


MODEL = _argv_model()
PLUGIN_MODELS = ("nemotron", "glm", "gemma4")  # --model all; gemma3 is dense
DEVICE = "cpu" if SMOKE else "cuda"
DTYPE = torch.float32 if SMOKE else torch.bfloat16
ROTATE = 2 if SMOKE else 8
# routed experts, routed top-k, shared experts (ids ROUTED.., every token's last slots), H, I, activation, gated
ROUTED, TOP_K, SHARED, HIDDEN, INTER, ACTIVATION, GATED = (256, 8, 1, 2048, 512, "silu", True)
PACKAGE = "armillary_qwen_gdn_moe"
if MODEL not in ("qwen", "all"):
    from decode_shapes import PACKAGES, moe_shapes  # noqa: E402

    PACKAGE = PACKAGES[MODEL]
    _found = moe_shapes(MODEL)
    if len(_found) != 1:
        raise SystemExit(f"moe_gemv: {MODEL} has {len(_found)} MoE shapes ({_found}); nothing to sweep")
    _s = _found[0]
    ROUTED, TOP_K, SHARED = _s.experts - _s.shared, _s.pairs - _s.shared, _s.shared
    HIDDEN, INTER, ACTIVATION, GATED = _s.hidden, _s.inter, _s.activation, _s.gated
if SMOKE:
    ROUTED, TOP_K, HIDDEN, INTER = 5, 2, 48, 24
EXPERTS = ROUTED + SHARED
ACT = _ACTIVATIONS[ACTIVATION]
UP_ROWS = 2 * INTER if GATED else INTER  # w13 rows per expert
tuning.use_packages((PACKAGE,))  # the shipped tables as the served model reads them
TOKENS = (1, 2) if SMOKE else (1, 2, 4, 8)
TOP = 3  # up / down configs carried into the whole-MoE stage
# (BLOCK_N1, BLOCK_K1, LOOP1, num_warps1); LOOP -1 unrolled, 0 plain, s > 0 tl.range(num_stages=s)
UP = [(1, 2048, -1, 1), (1, 2048, -1, 2), (1, 2048, -1, 4), (2, 2048, -1, 2), (2, 2048, -1, 4), (2, 2048, -1, 8),
      (2, 1024, -1, 4), (2, 1024, 0, 2), (4, 2048, -1, 4), (4, 2048, -1, 8), (4, 1024, -1, 4), (4, 512, -1, 4),
      (4, 512, 0, 4), (4, 512, 2, 4), (8, 2048, -1, 8), (8, 512, -1, 4), (8, 256, 0, 4), (8, 512, 2, 4),
      (8, 256, 3, 4), (16, 256, 3, 4)]
# (BLOCK_N2, BLOCK_K2, PAIR_BLOCK, LOOP2, num_warps2)
DOWN = [(1, 512, 16, -1, 2), (1, 512, 8, -1, 2), (2, 512, 16, -1, 4), (2, 512, 16, -1, 8), (2, 512, 8, -1, 4),
        (2, 512, 4, -1, 4), (2, 512, 1, -1, 4), (4, 512, 1, -1, 4), (4, 512, 2, -1, 4), (4, 512, 16, -1, 8),
        (4, 512, 8, -1, 8), (8, 512, 1, -1, 8), (8, 256, 1, 2, 4), (4, 256, 1, 0, 2)]
if MODEL != "qwen":  # other widths: K tiles that divide H / I or cover them in one or two tiles
    UP += [(1, 1024, -1, 1), (1, 1024, -1, 2), (1, 512, -1, 1), (1, 256, -1, 1), (2, 1024, -1, 2), (2, 512, -1, 2),
           (2, 256, -1, 1), (4, 256, -1, 2)]
    DOWN += [(1, 1024, 1, -1, 4), (2, 1024, 1, -1, 4), (1, 2048, 1, -1, 4), (2, 2048, 1, -1, 8), (2, 256, 1, -1, 2),
             (1, 256, 1, -1, 1), (2, 512, 1, 0, 2), (4, 1024, 1, 0, 4)]
if SMOKE:
    UP, DOWN = [(8, 32, -1, 2), (4, 16, 2, 1)], [(8, 16, 4, 0, 2), (16, 32, 1, -1, 1)]


def up_cfg(u: tuple) -> dict:
    return {"BLOCK_N1": u[0], "BLOCK_K1": u[1], "LOOP1": u[2], "num_warps1": u[3], "num_stages1": 1}


def down_cfg(d: tuple) -> dict:
    return {"BLOCK_N2": d[0], "BLOCK_K2": d[1], "PAIR_BLOCK": d[2], "LOOP2": d[3], "num_warps2": d[4], "num_stages2": 1}


def weights(seed: int, empty: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One copy of all experts: w13 [E, 2I, H] rows [gate | up] (non-gated: [E, I, H]), w2 [E, H, I]."""
    if empty:  # compile-only warm-up: the values do not matter
        return (torch.empty(EXPERTS, UP_ROWS, HIDDEN, device=DEVICE, dtype=DTYPE),
                torch.empty(EXPERTS, HIDDEN, INTER, device=DEVICE, dtype=DTYPE))
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    w13 = torch.randn(EXPERTS, UP_ROWS, HIDDEN, device=DEVICE, dtype=DTYPE, generator=g).mul_(HIDDEN**-0.5)
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, device=DEVICE, dtype=DTYPE, generator=g).mul_(INTER**-0.5)
    return w13, w2


def routing(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H], pair weights [T, k + S] float32, ids [T, k + S] int32 (distinct routed ids, then the shared ones)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g).to(DEVICE, DTYPE)
    ids = torch.stack([torch.randperm(ROUTED, generator=g)[:TOP_K] for _ in range(tokens)])
    shared = torch.arange(ROUTED, EXPERTS).expand(tokens, SHARED)
    ids = torch.cat((ids, shared), dim=1).to(DEVICE, torch.int32)
    w = torch.softmax(torch.randn(tokens, TOP_K, generator=g), dim=-1)
    w = torch.cat((w, torch.rand(tokens, SHARED, generator=g)), dim=1).to(DEVICE)  # shared: a sigmoid gate
    return x, w, ids


def reference(x, w13, w2, w, ids) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 torch: (h [T * (k+S), I], out [T, H])."""
    flat = ids.reshape(-1).long()
    xs = x.float().repeat_interleave(ids.shape[1], dim=0)  # [P, H]
    gu = torch.bmm(w13[flat].float(), xs[:, :, None])[:, :, 0]  # [P, 2I] (non-gated: [P, I])
    act = {"silu": torch.nn.functional.silu, "relu2": lambda v: torch.relu(v).square(),
           "gelu_pytorch_tanh": lambda v: torch.nn.functional.gelu(v, approximate="tanh")}[ACTIVATION]
    h = act(gu[:, :INTER]) * gu[:, INTER:] if GATED else act(gu)
    y = torch.bmm(w2[flat].float(), h[:, :, None])[:, :, 0] * w.reshape(-1, 1)  # [P, H]
    return h, y.view(x.shape[0], ids.shape[1], HIDDEN).sum(1)


def rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def graph_us(fn) -> float:
    """µs per MoE call of fn (ROTATE calls), replayed in a CUDA graph; smoke: one wall-clock run."""
    return bench_ms(fn, graph=True) * 1e3 / ROTATE


def timed(label: str, fn) -> tuple[float, object]:
    """fn() -> (µs, result), or (inf, None) printed when the config fails to compile or launch."""
    try:
        return fn()
    except Exception as e:  # a config over the resource limits, or an unsupported launch option
        print(f"  {label}: {type(e).__name__}: {str(e)[:160]}", flush=True)
        return float("inf"), None


def whole_cfg(u: tuple, d: tuple, pdl: bool) -> dict:
    return {**up_cfg(u), **down_cfg(d), "pdl": pdl}


def warm_worker(jobs: list[tuple]) -> int:
    """Compile (launch once on uninitialised weights) every job: ("up" | "down", candidate, pdl) | (path, T)."""
    w13, w2 = weights(0, empty=True)
    done = 0
    for job in jobs:
        try:
            x, w, ids = routing(job[1] if job[0] in ("decode", "grouped") else 1, 0)
            h = torch.zeros(ids.numel(), INTER, device=DEVICE)
            if job[0] == "up":
                gemv_up(x, w13, ids, h, GATED, ACT, {**up_cfg(job[1]), "pdl": job[2]})
            elif job[0] == "down":
                gemv_down(h, w2, ids, w, torch.empty_like(x), {**down_cfg(job[1]), "pdl": job[2]})
            else:
                fused_moe(x, w13, w2, w, ids, ACTIVATION, path=job[0])
            done += 1
        except Exception as e:  # the timed run reports it
            print(f"warm {job[:2]}: {type(e).__name__}: {str(e)[:120]}", flush=True)
    torch.cuda.synchronize()
    return done


def warm_compile(workers: int, jobs: list[tuple]) -> None:
    if SMOKE or workers <= 1:
        return
    import multiprocessing as mp

    start = time.time()
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        done = sum(pool.map(warm_worker, [jobs[i::workers] for i in range(workers)]))
    print(f"warm-up: {done}/{len(jobs)} launches compiled in {workers} processes, {time.time() - start:.0f} s",
          flush=True)


def bench_tokens(tokens: int, sets: list, per_expert: tuple[int, int]) -> dict:
    """All three stages at one token count; sets: ROTATE (w13, w2, x, w, ids, h, out)."""
    w13_0, w2_0, x0, w0, ids0, _, _ = sets[0]
    h_ref, out_ref = reference(x0, w13_0, w2_0, w0, ids0)
    experts = int(torch.unique(ids0).numel())
    up_bytes, down_bytes = experts * per_expert[0], experts * per_expert[1]
    tb = lambda nbytes, us: nbytes / us / 1e6  # noqa: E731

    def up_run(cfg):
        h = torch.full_like(sets[0][5], float("nan"))
        gemv_up(x0, w13_0, ids0, h, GATED, ACT, cfg)
        return graph_us(lambda: [gemv_up(s[2], s[0], s[4], s[5], GATED, ACT, cfg) for s in sets]), h

    def down_run(cfg):
        out = torch.full_like(x0, float("nan"))
        gemv_down(h_ref, w2_0, ids0, w0, out, cfg)
        return graph_us(lambda: [gemv_down(s[5], s[1], s[4], s[3], s[6], cfg) for s in sets]), out

    def moe_run(path, cfg=None):
        out = fused_moe(x0, w13_0, w2_0, w0, ids0, ACTIVATION, path=path, config=cfg)
        return graph_us(lambda: [fused_moe(s[2], s[0], s[1], s[3], s[4], ACTIVATION, path=path, config=cfg)
                                 for s in sets]), out

    def sweep(name, candidates, make_cfg, run, ref, nbytes):
        rows = []
        for c in candidates:
            us, out = timed(f"T={tokens} {name} {c}", lambda: run(make_cfg(c)))
            err = rel_err(out, ref) if out is not None else None
            rows.append({name: c, "us": us, "tb_s": tb(nbytes, us), "err": err})
        rows.sort(key=lambda r: r["us"] if r["err"] is not None and r["err"] < 2e-2 else float("inf"))
        bad = [r[name] for r in rows if r["err"] is not None and not r["err"] < 2e-2]
        print(f"T={tokens} {name:4} ({nbytes / 1e6:.1f} MB): " + ", ".join(
            f"{r[name]} {r['us']:.1f}us {r['tb_s']:.2f}TB/s" for r in rows[:5]) + (f"; WRONG {bad}" if bad else ""),
            flush=True)
        return rows

    ups = sweep("up", UP, up_cfg, up_run, h_ref, up_bytes)
    downs = sweep("down", DOWN, down_cfg, down_run, out_ref, down_bytes)
    base = {path: timed(f"T={tokens} {path}", lambda: moe_run(path)) for path in ("decode", "grouped")}
    dec_out = base["decode"][1]
    wholes = []
    for pdl in (False, True):  # PDL last: an unsupported launch option fails eagerly, before any capture
        for u in [r["up"] for r in ups[:TOP]]:
            for d in [r["down"] for r in downs[:TOP]]:
                cfg = whole_cfg(u, d, pdl)
                us, out = timed(f"T={tokens} gemv {cfg}", lambda: moe_run("gemv", cfg))
                row = {"config": cfg, "us": us, "tb_s": tb(up_bytes + down_bytes, us)}
                if out is not None:
                    row["err_vs_fp32"] = rel_err(out, out_ref)
                    row["err_vs_decode"] = rel_err(out, dec_out) if dec_out is not None else None
                wholes.append(row)
    ok = [r for r in wholes if r.get("err_vs_fp32", 1.0) < 2e-2]
    best = min(ok, key=lambda r: r["us"]) if ok else None
    result = {"tokens": tokens, "experts": experts, "expert_mb": (up_bytes + down_bytes) / 1e6,
              "up": ups, "down": downs, "gemv": wholes, "best": best}
    for path, (us, out) in base.items():
        result[f"{path}_us"] = us
        result[f"{path}_tb_s"] = tb(up_bytes + down_bytes, us)
        result[f"{path}_err_vs_fp32"] = rel_err(out, out_ref) if out is not None else None
    if best:
        print(f"T={tokens} gemv best {best['us']:.1f} us ({best['tb_s']:.2f} TB/s, err vs decode "
              f"{best.get('err_vs_decode')}, vs fp32 {best['err_vs_fp32']:.2e}) pdl={best['config']['pdl']}",
              flush=True)
    print(f"T={tokens} decode {result['decode_us']:.1f} us ({result['decode_tb_s']:.2f} TB/s), grouped "
          f"{result['grouped_us']:.1f} us ({result['grouped_tb_s']:.2f} TB/s)", flush=True)
    return result


def table_entry(results: list[dict]) -> dict:
    """The "fused_moe_gemv" tuning entry: max_tokens = the largest T up to which GEMV beats both other paths;
    "default" holds T=1's best config, a "t{T}" key only the keys where T's best differs."""
    max_tokens = 0
    for r in sorted(results, key=lambda r: r["tokens"]):
        if r["best"] is None or r["best"]["us"] >= min(r["decode_us"], r["grouped_us"]):
            break
        max_tokens = r["tokens"]
    bests = {r["tokens"]: r["best"]["config"] for r in results if r["best"] is not None}
    base = bests[min(bests)] if bests else {}
    entry: dict = {"default": {"max_tokens": max_tokens, **base}}
    for tokens, cfg in sorted(bests.items()):
        diff = {k: v for k, v in cfg.items() if base.get(k) != v}
        if diff:
            entry[gemv_config_key(tokens)] = diff
    return entry


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--workers", type=int, default=1 if SMOKE else 12)
    parser.add_argument("--model", default="qwen", choices=("qwen", *PLUGIN_MODELS, "gemma3", "all"),
                        help="whose expert shape: qwen (default), a plugin model, or all plugin models")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.model == "gemma3":
        print("gemma3 is dense: no MoE to sweep")
        return
    if args.model == "all":
        run_all(args)
        return
    start = time.time()
    import triton

    pdl_ok = gdc_wait is not None
    print(f"torch {torch.__version__}, triton {triton.__version__}, PDL {'available' if pdl_ok else 'unavailable'}",
          flush=True)
    token_counts = [int(t) for t in args.tokens.split(",")]
    jobs = [(kind, c, pdl) for pdl in (False, True) for kind, cands in (("up", UP), ("down", DOWN)) for c in cands]
    jobs += [(path, t) for t in token_counts for path in ("decode", "grouped")]  # T changes their constexprs
    warm_compile(args.workers, jobs)
    copies = [weights(r + 1) for r in range(ROTATE)]  # ROTATE x all experts: ~13 GB on the real shapes
    w13, w2 = copies[0]
    per_expert = (w13[0].numel() * w13.element_size(), w2[0].numel() * w2.element_size())  # bytes of one expert
    results = []
    path = Path(args.out, "moe_gemv.json")
    for tokens in token_counts:
        sets = []
        for r, (w13, w2) in enumerate(copies):
            x, w, ids = routing(tokens, 100 * tokens + r)
            h = torch.randn(ids.numel(), INTER, device=DEVICE)
            sets.append((w13, w2, x, w, ids, h, torch.empty_like(x)))
        results.append(bench_tokens(tokens, sets, per_expert))
        entry = table_entry(results)
        path.write_text(json.dumps({"model": MODEL, "package": PACKAGE,
                                    "device": "cpu-interpreter" if SMOKE else torch.cuda.get_device_name(),
                                    "triton": triton.__version__, "pdl_available": pdl_ok, "results": results,
                                    "table": entry, "elapsed_s": time.time() - start}, indent=1))
    print("\nT     gemv_us  TB/s   decode_us  grouped_us  best gemv config")
    for r in results:
        b = r["best"] or {"us": float("inf"), "tb_s": 0.0, "config": None}
        print(f"{r['tokens']:<5} {b['us']:7.1f}  {b['tb_s']:4.2f}   {r['decode_us']:9.1f}  {r['grouped_us']:10.1f}  "
              f"{json.dumps(b['config'])}")
    print(f"crossover: GEMV up to T={entry['default']['max_tokens']}")
    print(f'"fused_moe_gemv" entry for {PACKAGE}/tuning/sm_90.json ({MODEL}):\n' + json.dumps(entry))
    print(f"done in {time.time() - start:.0f} s -> {path}")


def run_all(args) -> None:
    """Each plugin model in its own process (the shape is fixed at import), then DIR/moe_gemv_tables.json:
    {package: {"fused_moe_gemv": entry}}."""
    import subprocess

    tables, failed = {}, []
    for model in PLUGIN_MODELS:
        out = Path(args.out, model)
        cmd = [sys.executable, __file__, "--out", str(out), "--model", model, "--tokens", args.tokens,
               "--workers", str(args.workers), *(["--smoke"] if SMOKE else [])]
        print("$", " ".join(cmd[1:]), flush=True)
        result = out / "moe_gemv.json"
        if subprocess.run(cmd).returncode != 0 or not result.exists():
            failed.append(model)
            continue
        done = json.loads(result.read_text())
        tables[done["package"]] = {"fused_moe_gemv": done["table"]}
    Path(args.out, "moe_gemv_tables.json").write_text(json.dumps(tables, indent=1))
    print(f"entries for {sorted(tables)} -> {Path(args.out, 'moe_gemv_tables.json')}" +
          (f"; FAILED {failed}" if failed else ""))
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
