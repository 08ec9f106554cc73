"""Launch-config sweep of the FP8 MoE decode GEMV (up and down kernels apart) at the Qwen3.6-35B-A3B expert shape, in CUDA graphs, bf16 moe_gemv as the same-run reference.

    python bench/fp8_moe_gemv_sweep.py                  # H200: JSON to $OUT (or --out DIR), <= --deadline-s 120
    python bench/fp8_moe_gemv_sweep.py --write          # also merge the winners into the installed Qwen plugin's
                                                        # tuning/sm_90.json (every other entry kept)
    python bench/fp8_moe_gemv_sweep.py --merge DIR/fp8_moe_gemv_table.json   # no GPU: merge a GPU run's entry
                                                        # into the installed table (as --write would have)
    python bench/fp8_moe_gemv_sweep.py --smoke --write --out DIR   # CPU (TRITON_INTERPRET=1): tiny shapes, every
                                                        # path, the merge written to DIR/sm_90.json

Shape: H 2048, I 512, 256 routed experts + the shared expert fused as id 256 (what ``SparseMoeBlock`` hands
``FusedMoE``: ids [T, 8 + 1], the shared id last with a sigmoid-gate weight), 128 x 128 block e4m3 weights
from ``armillary.kernels.fp8.quantize_blocks``. ROTATE copies of all experts; call i of a graph uses copy
i % ROTATE (> 120 MB streamed between two uses of a copy, L2 is 50 MB), distinct routed ids per token.
Per T in 1, 2, 4, 8: the table's current pick, every UP config (rows per program, tile width, warps, stages)
and every DOWN config (rows, width, warps), each kernel alone in one CUDA graph of >= 20 back-to-back calls
(``skinny_gemm.time_calls``); the current and best pairs as the whole GEMV MoE; bf16 ``moe_gemv`` (up, down,
whole) on the dequantized weights with the bf16 table's config. Errors: max|out - ref| / max|ref| against
the fp32 dequantized torch reference. GB/s: the distinct experts' weight (and scale) bytes per call.
Writes $OUT/fp8_moe_gemv_sweep.json and $OUT/fp8_moe_gemv_table.json ({"fp8_moe_gemv": {key: cfg}}: a
kernel's keys only where its best beats the current pick by > 3%). PDL follows ``ARMILLARY_PDL`` / the tables.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))

from armillary.kernels import fp8 as ref  # noqa: E402
from armillary.kernels import tuning  # noqa: E402
from armillary.kernels.triton import fp8_moe  # noqa: E402
from armillary.kernels.triton import moe as bf16_moe  # noqa: E402
from armillary.kernels.triton import moe_gemv  # noqa: E402
from armillary.kernels.triton.fp8_skinny import pdl_options  # noqa: E402
from autotune import merge, render, table_path  # noqa: E402
from skinny_gemm import compile_in_workers, rel_err, time_calls  # noqa: E402

QWEN = "armillary_qwen_gdn_moe"
DEVICE = "cpu" if SMOKE else "cuda"
DTYPE = torch.float32 if SMOKE else torch.bfloat16  # the interpreter miscomputes bf16
ROUTED, TOP_K, HIDDEN, INTER, BLOCK = 256, 8, 2048, 512, (128, 128)
TOKENS = (1, 2, 4, 8)
ROTATE = 8
# up: (BLOCK_N1, BLOCK_K1, num_warps1, num_stages1); down: (BLOCK_N2, BLOCK_K2, num_warps2)
UP = [(bn, w, nw, st) for bn in (1, 2, 4, 8) for w in (512, 1024, 2048) for nw in (1, 2, 4, 8) for st in (1, 2)]
DOWN = [(bn, w, nw) for bn in (2, 4, 8, 16) for w in (256, 512) for nw in (1, 2, 4, 8)]
if SMOKE:
    ROUTED, TOP_K, HIDDEN, INTER, BLOCK = 5, 2, 80, 48, (16, 32)  # odd: K tiles past H and I, N tiles past I
    TOKENS, ROTATE = (1, 2), 2
    UP, DOWN = [(8, 32, 2, 1), (16, 16, 1, 2)], [(16, 32, 2), (32, 64, 1)]
EXPERTS, SLOTS = ROUTED + 1, TOP_K + 1  # the shared expert: id ROUTED, every token's last slot
UP = [u for u in UP if u[3] == 1 or math.ceil(HIDDEN / u[1]) > 1]  # one K tile: no loop to pipeline
WIN = 0.97  # a pick must be 3% faster than the current one to enter the table
TOL = 2e-2  # bf16 outputs: ~4e-3 expected
tuning.use_packages((QWEN,))  # the shipped tables, as the served model reads them


def up_cfg(u: tuple) -> dict:
    return {"BLOCK_N1": u[0], "BLOCK_K1": u[1], "num_warps1": u[2], "num_stages1": u[3]}


def down_cfg(d: tuple) -> dict:
    return {"BLOCK_N2": d[0], "BLOCK_K2": d[1], "num_warps2": d[2], "num_stages2": 1}


def current_config(tokens: int) -> dict:
    return fp8_moe.gemv_config(EXPERTS, HIDDEN, INTER, SLOTS, tokens, torch.device(DEVICE))


def weights(seed: int) -> dict:
    """One copy of all experts: fp8 w13 [E, 2I, H] / w2 [E, H, I] with block scales, and their bf16 dequantization."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    w13, s13 = ref.quantize_blocks(torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=DEVICE, generator=g,
                                               dtype=DTYPE) * HIDDEN**-0.5, *BLOCK)
    w2, s2 = ref.quantize_blocks(torch.randn(EXPERTS, HIDDEN, INTER, device=DEVICE, generator=g,
                                             dtype=DTYPE) * INTER**-0.5, *BLOCK)
    return {"w13": w13, "s13": s13, "w2": w2, "s2": s2, "w13b": ref.dequantize(w13, s13, *BLOCK, DTYPE),
            "w2b": ref.dequantize(w2, s2, *BLOCK, DTYPE)}


def routing(tokens: int, seed: int) -> dict:
    """x [T, H], ids [T, k + 1] int32 (distinct routed ids, then the shared id), weights [T, k + 1] fp32."""
    g = torch.Generator().manual_seed(seed)
    routed = torch.stack([torch.randperm(ROUTED, generator=g)[:TOP_K] for _ in range(tokens)])
    ids = torch.cat((routed, torch.full((tokens, 1), ROUTED)), dim=1).to(DEVICE, torch.int32)
    w = torch.cat((torch.rand(tokens, TOP_K, generator=g).softmax(-1), torch.rand(tokens, 1, generator=g)), dim=1)
    x = torch.randn(tokens, HIDDEN, generator=g).to(DEVICE, DTYPE)
    return {"x": x, "ids": ids, "w": w.to(DEVICE)}


def reference(copy: dict, route: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 torch on the dequantized experts: (h [T·(k+1), I], out [T, H])."""
    flat = route["ids"].reshape(-1).long()
    pick = lambda w: w.view(torch.uint8)[flat].view(w.dtype)  # noqa: E731 - gathered as bytes: any torch's index
    w13 = ref.dequantize(pick(copy["w13"]), copy["s13"][flat], *BLOCK)  # [P, 2I, H]
    gu = torch.bmm(w13, route["x"].float().repeat_interleave(SLOTS, dim=0)[:, :, None])[:, :, 0]  # [P, 2I]
    h = torch.nn.functional.silu(gu[:, :INTER]) * gu[:, INTER:]
    w2 = ref.dequantize(pick(copy["w2"]), copy["s2"][flat], *BLOCK)  # [P, H, I]
    y = torch.bmm(w2, h[:, :, None])[:, :, 0] * route["w"].reshape(-1, 1)  # [P, H]
    return h, y.view(-1, SLOTS, HIDDEN).sum(1)


def warm_worker(job: tuple) -> bool:
    """Compile one config (Triton's disk cache) by one launch on two zero experts of the real shape."""
    kind, cand = job
    try:
        dev = torch.device(DEVICE)
        w13 = torch.empty(2, 2 * INTER, HIDDEN, device=dev, dtype=torch.float8_e4m3fn)  # values unused
        s13 = torch.ones(2, math.ceil(2 * INTER / BLOCK[0]), math.ceil(HIDDEN / BLOCK[1]), device=dev)
        w2 = torch.empty(2, HIDDEN, INTER, device=dev, dtype=torch.float8_e4m3fn)
        s2 = torch.ones(2, math.ceil(HIDDEN / BLOCK[0]), math.ceil(INTER / BLOCK[1]), device=dev)
        ids = torch.zeros(1, SLOTS, device=dev, dtype=torch.int32)
        h = torch.zeros(SLOTS, INTER, device=dev)
        if kind == "up":
            fp8_moe.gemv_up(torch.zeros(1, HIDDEN, device=dev, dtype=DTYPE), w13, s13, *BLOCK, ids, h, "silu",
                            up_cfg(cand))
        else:
            fp8_moe.gemv_down(h, w2, s2, *BLOCK, ids, torch.ones(1, SLOTS, device=dev),
                              torch.empty(1, HIDDEN, device=dev, dtype=DTYPE), down_cfg(cand))
        torch.cuda.synchronize()
        return True
    except Exception as e:  # the timed run reports it
        print(f"warm {kind} {cand}: {type(e).__name__}: {str(e)[:160]}", flush=True)
        return False


def warm_compile(workers: int, jobs: list[tuple], until: float) -> None:
    """Compile ``jobs`` in spawned workers until ``until``; what is left compiles on first use."""
    if not SMOKE and workers > 1:
        compile_in_workers(warm_worker, jobs, workers, until - time.time())


def measure(label: str, fn, copies: int, ref_out: torch.Tensor | None) -> dict:
    """µs per call of fn(i) in one graph and the error of copy 0's output; inf when it fails."""
    try:
        us, outs = time_calls(fn, copies)
        err = rel_err(outs[0], ref_out) if ref_out is not None else None
        return {"us": us, "err": err, "ok": err is None or err < TOL}
    except Exception as e:  # over a resource limit, or an unsupported launch
        print(f"  {label}: {type(e).__name__}: {str(e)[:160]}", flush=True)
        return {"us": float("inf"), "err": None, "ok": False}


def interleave(ups: list[tuple], downs: list[tuple]) -> list[tuple[str, tuple]]:
    """("up", u) and ("down", d) candidates in proportion, the down ones spread among the up ones."""
    order = [("up", u, i / len(ups)) for i, u in enumerate(ups)]
    order += [("down", d, i / len(downs)) for i, d in enumerate(downs)]
    return [(kind, cand) for kind, cand, _ in sorted(order, key=lambda o: o[2])]


def bench_tokens(tokens: int, copies: list[dict], deadline: float) -> dict:
    routes = [routing(tokens, 100 * tokens + i) for i in range(len(copies))]
    refs = [reference(c, r) for c, r in zip(copies, routes)]
    n = len(copies)
    experts = int(torch.unique(routes[0]["ids"]).numel())
    up_bytes = experts * (2 * INTER * HIDDEN + copies[0]["s13"][0].numel() * 4)
    down_bytes = experts * (HIDDEN * INTER + copies[0]["s2"][0].numel() * 4)
    hs = [torch.empty(tokens * SLOTS, INTER, device=DEVICE) for _ in range(n)]
    outs = [torch.empty(tokens, HIDDEN, device=DEVICE, dtype=DTYPE) for _ in range(n)]

    def up(cfg):
        return lambda i: (fp8_moe.gemv_up(routes[i]["x"], copies[i]["w13"], copies[i]["s13"], *BLOCK, routes[i]["ids"],
                                          hs[i], "silu", cfg), hs[i])[1]

    def down(cfg):
        return lambda i: (fp8_moe.gemv_down(refs[i][0], copies[i]["w2"], copies[i]["s2"], *BLOCK, routes[i]["ids"],
                                            routes[i]["w"], outs[i], cfg), outs[i])[1]

    def pair(cfg):
        return lambda i: fp8_moe._gemv_moe(routes[i]["x"], copies[i]["w13"], copies[i]["s13"], copies[i]["w2"],
                                           copies[i]["s2"], *BLOCK, routes[i]["w"], routes[i]["ids"], "silu", cfg)

    bcfg = bf16_moe.gemv_config(tokens, torch.device(DEVICE))  # the bf16 table's pick at this T
    act = bf16_moe._ACTIVATIONS["silu"]
    bf16 = {
        "config": bcfg,
        "up": measure("bf16 up", lambda i: (moe_gemv.gemv_up(routes[i]["x"], copies[i]["w13b"], routes[i]["ids"], hs[i],
                                                             True, act, bcfg), hs[i])[1], n, refs[0][0]),
        "down": measure("bf16 down", lambda i: (moe_gemv.gemv_down(refs[i][0], copies[i]["w2b"], routes[i]["ids"],
                                                                   routes[i]["w"], outs[i], bcfg), outs[i])[1],
                        n, refs[0][1]),
        "pair": measure("bf16 moe_gemv", lambda i: moe_gemv.moe_gemv(
            routes[i]["x"], copies[i]["w13b"], copies[i]["w2b"], routes[i]["w"], routes[i]["ids"],
            torch.empty(tokens, HIDDEN, device=DEVICE, dtype=DTYPE), True, act, bcfg), n, refs[0][1]),
        "pdl": moe_gemv._pdl(bcfg, torch.device(DEVICE)),
    }
    cur = current_config(tokens)
    current = {"config": cur, "up": measure("current up", up(cur), n, refs[0][0]),
               "down": measure("current down", down(cur), n, refs[0][1]),
               "pair": measure("current pair", pair(cur), n, refs[0][1])}
    # the prefill path: what fp8_fused_moe takes above GEMV_MAX_PAIRS (T=8: 72 pairs); its activations are e4m3
    grouped = measure("grouped", lambda i: fp8_moe.fp8_fused_moe(
        routes[i]["x"], copies[i]["w13"], copies[i]["s13"], copies[i]["w2"], copies[i]["s2"], *BLOCK, routes[i]["w"],
        routes[i]["ids"], "silu", grouped=True), n, refs[0][1])
    rows = {"up": [], "down": []}
    kinds = {"up": (up_cfg, up, refs[0][0]), "down": (down_cfg, down, refs[0][1])}
    for kind, cand in interleave(UP, DOWN):  # both kernels progress if the deadline comes first
        if time.time() > deadline:
            break
        make, run, want = kinds[kind]
        rows[kind].append({"config": make(cand), **measure(f"T={tokens} {kind} {cand}", run({**cur, **make(cand)}), n,
                                                           want)})
    best = {kind: min((r for r in rows[kind] if r["ok"]), key=lambda r: r["us"], default=None) for kind in rows}
    pick = {kind: best[kind]["config"] for kind in best
            if best[kind] is not None and best[kind]["us"] < WIN * current[kind]["us"]}
    chosen = {**cur, **pick.get("up", {}), **pick.get("down", {})}
    best_pair = measure("best pair", pair(chosen), n, refs[0][1]) if pick else current["pair"]
    return {"tokens": tokens, "key": fp8_moe.gemv_config_key(EXPERTS, HIDDEN, INTER, SLOTS, tokens), "experts": experts,
            "up_bytes": up_bytes, "down_bytes": down_bytes, "current": current, "bf16": bf16, "rows": rows,
            "best": best, "pick": pick, "chosen": chosen, "best_pair": best_pair, "grouped": grouped,
            "gemv_path_taken": tokens * SLOTS <= fp8_moe.GEMV_MAX_PAIRS,
            "fp8_pdl": pdl_options(torch.device(DEVICE))["PDL"], "complete": time.time() <= deadline}


def line(r: dict) -> str:
    """One line per T: current, best (+ config) and bf16 µs and GB/s of up, down and the pair."""
    gb = lambda nbytes, us: nbytes / (us * 1e3)  # noqa: E731
    parts = []
    for kind, nbytes in (("up", r["up_bytes"]), ("down", r["down_bytes"])):
        cur, best, b16 = r["current"][kind], r["best"][kind], r["bf16"][kind]
        best_txt = (f"best {best['us']:.1f}us {gb(nbytes, best['us']):.0f}GB/s {list(best['config'].values())}"
                    if best else "best -")
        parts.append(f"{kind} cur {cur['us']:.1f}us {gb(nbytes, cur['us']):.0f}GB/s {best_txt} | "
                     f"bf16 {b16['us']:.1f}us {gb(2 * nbytes, b16['us']):.0f}GB/s")
    both = r["up_bytes"] + r["down_bytes"]
    p, bp, b16 = r["current"]["pair"], r["best_pair"], r["bf16"]["pair"]
    parts.append(f"pair cur {p['us']:.1f}us {gb(both, p['us']):.0f}GB/s best {bp['us']:.1f}us "
                 f"{gb(both, bp['us']):.0f}GB/s | bf16 {b16['us']:.1f}us {gb(2 * both, b16['us']):.0f}GB/s | "
                 f"fp8 grouped {r['grouped']['us']:.1f}us (err {r['grouped']['err'] or float('nan'):.1e}; served path: "
                 f"{'gemv' if r['gemv_path_taken'] else 'grouped'})")
    bad = [f"{k} {r['current'][k]['err']}" for k in ("up", "down", "pair") if not r["current"][k]["ok"]]
    wrong = [f"{k} {row['config']}" for k in r["rows"] for row in r["rows"][k]
             if not row["ok"] and row["err"] is not None]
    return (f"T={r['tokens']} ({r['experts']} experts): " + "; ".join(parts) +
            (f"; CURRENT WRONG {bad}" if bad else "") + (f"; WRONG {wrong}" if wrong else ""))


def table_entry(results: list[dict]) -> dict:
    return {r["key"]: {k: v for kind in ("up", "down") for k, v in r["pick"].get(kind, {}).items()}
            for r in results if r["pick"]}


def write_table(entry: dict, path: Path, command: str, device: str) -> None:
    """Merge ``entry`` into the table at ``path``: other kernels kept, other keys of fp8_moe_gemv kept, each
    swept key updated with the new keys only."""
    table = json.loads(path.read_text()) if path.exists() else {}
    old = table.get(fp8_moe.GEMV_KERNEL, {})
    comment = (f"bench/fp8_moe_gemv_sweep.py on {device}: `{command}`; keys e{{E}}_h{{H}}_i{{I}}_k{{slots}}_t{{T up to "
               "2^i}; a kernel's keys only where > 3% faster than the previous pick")
    swept = {key: {**old.get(key, {}), **cfg} for key, cfg in entry.items()}  # a key's other kernel's keys kept
    table = merge(table, {fp8_moe.GEMV_KERNEL: swept}, comment, by_key=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(render(table))
    os.replace(tmp, path)
    print(f"merged {sorted(entry)} into {path}", flush=True)


def merge_result(table_file: Path) -> None:
    """--merge: a GPU run's table entry into the installed Qwen table, stamped with that run's device and command."""
    entry = json.loads(table_file.read_text())[fp8_moe.GEMV_KERNEL]
    run = table_file.with_name("fp8_moe_gemv_sweep.json")
    info = json.loads(run.read_text()) if run.exists() else {}
    if not entry:
        print(f"{table_file}: an empty entry; the table stays as it is")
        return
    command = " ".join(["python bench/fp8_moe_gemv_sweep.py", *info.get("argv", ["?"])])
    write_table(entry, table_path(QWEN, "sm_90"), command, info.get("device", "unknown GPU"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT"), help="results folder (default $OUT)")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--write", action="store_true", help="merge the entry into the Qwen plugin's sm_90.json")
    parser.add_argument("--merge", type=Path, help="merge this fp8_moe_gemv_table.json into the table; no sweep")
    parser.add_argument("--deadline-s", type=float, default=120.0)
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--workers", type=int, default=1 if SMOKE else 12)
    args = parser.parse_args()
    if args.merge:
        merge_result(args.merge)
        return
    if not args.out:
        parser.error("--out or $OUT is required")
    start = time.time()
    deadline = start + args.deadline_s
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import triton

    jobs = [("up", u) for u in UP] + [("down", d) for d in DOWN]
    warm_compile(args.workers, jobs, start + 0.6 * args.deadline_s)
    copies = [weights(i + 1) for i in range(ROTATE)]
    results = []
    info = {"device": "cpu-interpreter" if SMOKE else torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "ARMILLARY_PDL": os.environ.get("ARMILLARY_PDL"),
            "shape": {"experts": EXPERTS, "slots": SLOTS, "hidden": HIDDEN, "inter": INTER, "block": BLOCK},
            "rotate": ROTATE, "argv": sys.argv[1:]}
    token_counts = [int(t) for t in args.tokens.split(",")]
    print(f"torch {torch.__version__}, triton {triton.__version__}, {info['device']}, fp8 PDL "
          f"{pdl_options(torch.device(DEVICE))['PDL']}, ARMILLARY_PDL={info['ARMILLARY_PDL']}; {len(UP)} up and "
          f"{len(DOWN)} down configs; best configs print as up [BLOCK_N1, BLOCK_K1, num_warps1, num_stages1], "
          "down [BLOCK_N2, BLOCK_K2, num_warps2, num_stages2]", flush=True)
    for j, tokens in enumerate(token_counts):  # the time left shared evenly by the token counts still to run
        now = time.time()
        results.append(bench_tokens(tokens, copies, now + max(0.0, deadline - now) / (len(token_counts) - j)))
        print(line(results[-1]), flush=True)
        entry = table_entry(results)
        (out / "fp8_moe_gemv_sweep.json").write_text(json.dumps(
            {**info, "results": results, "table": {fp8_moe.GEMV_KERNEL: entry}, "elapsed_s": time.time() - start,
             "deadline_hit": time.time() > deadline}, indent=1, default=str))
        (out / "fp8_moe_gemv_table.json").write_text(json.dumps({fp8_moe.GEMV_KERNEL: entry}, indent=1))
    print(f'"fp8_moe_gemv" entry ({len(entry)} keys): {json.dumps(entry)}')
    if args.write:
        if not entry:
            print("--write: no pick beats the current one by > 3%; the table stays as it is")
        else:
            path = table_path(QWEN, "sm_90")
            if SMOKE:  # interpreter timings never reach the package: a copy of its table takes the merge
                target = out / "sm_90.json"
                target.write_text(path.read_text())
                path = target
            write_table(entry, path, " ".join(["python bench/fp8_moe_gemv_sweep.py", *sys.argv[1:]]), info["device"])
    print(f"done in {time.time() - start:.0f} s -> {out / 'fp8_moe_gemv_sweep.json'}")


if __name__ == "__main__":
    main()
