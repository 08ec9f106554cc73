"""Launch-config sweep of the NVFP4 MoE decode GEMV (up and down kernels apart) at the Qwen3.6-35B-A3B expert shape, in CUDA graphs, bf16 moe_gemv as the same-run reference.

    python bench/fp4_moe_gemv_sweep.py --workers 16              # H200: JSON to $OUT (or --out DIR)
    python bench/fp4_moe_gemv_sweep.py --workers 16 --write      # also merge the winners into the Qwen plugin's tuning/sm_90.json
    python bench/fp4_moe_gemv_sweep.py --merge DIR/fp4_moe_gemv_table.json   # no GPU: merge a GPU run's entry
    python bench/fp4_moe_gemv_sweep.py --tiny --device cpu --out DIR [--write --table T]   # CPU interpreter smoke

Shape: ``decode_shapes.moe_shapes("qwen")`` (H 2048, I 512, 256 routed experts + the shared one as id 256,
ids [T, 8 + 1]); NVFP4 experts from ``armillary.kernels.fp4.quantize_nvfp4`` with row global scales, ROTATE
copies (call i of a graph uses copy i % ROTATE: > 120 MB between two uses of a copy). Per T in 1, 2, 4: the
table's current pick, every UP config (rows per program, K tile, warps) and every DOWN config, each kernel alone
in one CUDA graph of >= 20 calls, the current and best pairs as the whole GEMV MoE, and bf16 ``moe_gemv`` (up,
down, whole) on the dequantized experts — fp8_moe_gemv_sweep's ``measure`` / ``interleave`` / ``table_entry``.
Errors: max|out - ref| / max|ref| against the fp32 dequantized torch reference. Writes
$OUT/fp4_moe_gemv_sweep.json and $OUT/fp4_moe_gemv_table.json ({"fp4_moe_gemv": {key: cfg}}: a kernel's keys
only where its best beats the current pick by > 3%); ``--write`` merges it into the Qwen plugin's table (``--table``: another).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# --device cpu: fp4_skinny_sweep sets TRITON_INTERPRET before triton loads and makes skinny_gemm.time_calls eager
from fp4_skinny_sweep import CPU, TINY  # noqa: E402

import torch  # noqa: E402

import skinny_gemm  # noqa: E402
from autotune import merge, render, table_path  # noqa: E402
from decode_shapes import moe_shapes  # noqa: E402
from fp8_moe_gemv_sweep import interleave, measure, table_entry  # noqa: E402
from skinny_gemm import compile_in_workers  # noqa: E402

from armillary.kernels import fp4 as ref  # noqa: E402
from armillary.kernels import tuning  # noqa: E402
from armillary.kernels.triton import fp4_moe  # noqa: E402
from armillary.kernels.triton import moe as bf16_moe  # noqa: E402
from armillary.kernels.triton import moe_gemv  # noqa: E402
from armillary.kernels.triton.fp8_skinny import pdl_options  # noqa: E402

QWEN = "armillary_qwen_gdn_moe"
DEVICE = "cpu" if CPU else "cuda"
DTYPE = torch.float32 if CPU else torch.bfloat16  # the interpreter miscomputes bf16
if TINY:
    ROUTED, TOP_K, HIDDEN, INTER = 5, 2, 80, 48  # odd: K tiles past H and I, N tiles past I
    TOKENS, ROTATE = (1, 2), 2
    UP, DOWN = [(8, 32, 2), (2, 64, 1)], [(16, 32, 2), (8, 16, 1)]
else:
    _SHAPE = moe_shapes("qwen")[0]
    ROUTED, TOP_K, HIDDEN, INTER = _SHAPE.experts - _SHAPE.shared, _SHAPE.pairs - _SHAPE.shared, _SHAPE.hidden, \
        _SHAPE.inter
    TOKENS, ROTATE = (1, 2, 4), 10  # T=1: 9 experts x 1.6 MB a copy
    # up: (BLOCK_N1, BLOCK_K1, num_warps1); down: (BLOCK_N2, BLOCK_K2, num_warps2)
    UP = [(bn, w, nw) for bn in (1, 2, 4, 8, 16) for w in (512, 1024, 2048) for nw in (1, 2, 4, 8)]
    DOWN = [(bn, w, nw) for bn in (2, 4, 8, 16, 32) for w in (128, 256, 512) for nw in (1, 2, 4, 8)]
EXPERTS, SLOTS = ROUTED + 1, TOP_K + 1  # the shared expert: id ROUTED, every token's last slot
tuning.use_packages((QWEN,))  # the shipped tables, as the served model reads them


def up_cfg(u: tuple) -> dict:
    return {"BLOCK_N1": u[0], "BLOCK_K1": u[1], "num_warps1": u[2]}


def down_cfg(d: tuple) -> dict:
    return {"BLOCK_N2": d[0], "BLOCK_K2": d[1], "num_warps2": d[2]}


def current_config(tokens: int) -> dict:
    return fp4_moe.gemv_config(EXPERTS, HIDDEN, INTER, SLOTS, tokens, torch.device(DEVICE))


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[E, N, K] -> packed [E, N, K / 2], e4m3 [E, N, K / 16], fp32 row globals [E, N]; 32 experts at a time."""
    parts = [ref.quantize_nvfp4(chunk) for chunk in w.split(32)]
    packed, scale, glob = (torch.cat(p) for p in zip(*parts))
    return packed, scale, ref.row_global_scale(glob, w.shape[1]).to(w.device)


def weights(seed: int) -> dict:
    """One copy of all experts: NVFP4 w13 [E, 2I, H] / w2 [E, H, I], and their bf16 dequantization."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    w13, s13, g13 = _quantize(torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=DEVICE, generator=g) * HIDDEN**-0.5)
    w2, s2, g2 = _quantize(torch.randn(EXPERTS, HIDDEN, INTER, device=DEVICE, generator=g) * INTER**-0.5)
    return {"w13": w13, "s13": s13, "g13": g13, "w2": w2, "s2": s2, "g2": g2,
            "w13b": ref.dequantize(w13, s13, g13, DTYPE), "w2b": ref.dequantize(w2, s2, g2, DTYPE)}


def routing(tokens: int, seed: int) -> dict:
    """x [T, H], ids [T, k + 1] int32 (distinct routed ids, then the shared id), weights [T, k + 1] fp32."""
    g = torch.Generator().manual_seed(seed)
    routed = torch.stack([torch.randperm(ROUTED, generator=g)[:TOP_K] for _ in range(tokens)])
    ids = torch.cat((routed, torch.full((tokens, 1), ROUTED)), dim=1).to(DEVICE, torch.int32)
    w = torch.cat((torch.rand(tokens, TOP_K, generator=g).softmax(-1), torch.rand(tokens, 1, generator=g)), dim=1)
    return {"x": torch.randn(tokens, HIDDEN, generator=g).to(DEVICE, DTYPE), "ids": ids, "w": w.to(DEVICE)}


def reference(copy: dict, route: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 torch on the dequantized experts: (h [T·(k+1), I], out [T, H])."""
    flat = route["ids"].reshape(-1).long()
    w13 = ref.dequantize(copy["w13"][flat], copy["s13"][flat], copy["g13"][flat])  # [P, 2I, H]
    gu = torch.bmm(w13, route["x"].float().repeat_interleave(SLOTS, dim=0)[:, :, None])[:, :, 0]  # [P, 2I]
    h = torch.nn.functional.silu(gu[:, :INTER]) * gu[:, INTER:]
    w2 = ref.dequantize(copy["w2"][flat], copy["s2"][flat], copy["g2"][flat])  # [P, H, I]
    y = torch.bmm(w2, h[:, :, None])[:, :, 0] * route["w"].reshape(-1, 1)  # [P, H]
    return h, y.view(-1, SLOTS, HIDDEN).sum(1)


def warm_worker(job: tuple) -> bool:
    """Compile one config (Triton's disk cache) by one launch on two zero experts of the real shape."""
    kind, cand = job
    try:
        dev = torch.device(DEVICE)
        e4m3 = torch.float8_e4m3fn
        ids = torch.zeros(1, SLOTS, device=dev, dtype=torch.int32)
        h = torch.zeros(SLOTS, INTER, device=dev)
        if kind == "up":
            fp4_moe.gemv_up(torch.zeros(1, HIDDEN, device=dev, dtype=DTYPE),
                            torch.zeros(2, 2 * INTER, HIDDEN // 2, device=dev, dtype=torch.uint8),
                            torch.ones(2, 2 * INTER, HIDDEN // 16, device=dev).to(e4m3),
                            torch.ones(2, 2 * INTER, device=dev), ids, h, "silu", up_cfg(cand))
        else:
            fp4_moe.gemv_down(h, torch.zeros(2, HIDDEN, INTER // 2, device=dev, dtype=torch.uint8),
                              torch.ones(2, HIDDEN, INTER // 16, device=dev).to(e4m3), torch.ones(2, HIDDEN, device=dev),
                              ids, torch.ones(1, SLOTS, device=dev), torch.empty(1, HIDDEN, device=dev, dtype=DTYPE),
                              down_cfg(cand))
        torch.cuda.synchronize()
        return True
    except Exception as e:  # the timed run reports it
        print(f"warm {kind} {cand}: {type(e).__name__}: {str(e)[:160]}", flush=True)
        return False


def bench_tokens(tokens: int, copies: list[dict], deadline: float, min_gain: float = 0.03) -> dict:
    routes = [routing(tokens, 100 * tokens + i) for i in range(len(copies))]
    refs = [reference(c, r) for c, r in zip(copies, routes)]
    n = len(copies)
    experts = int(torch.unique(routes[0]["ids"]).numel())
    up_bytes = experts * 2 * INTER * (HIDDEN // 2 + HIDDEN // 16 + 4)  # codes, group scales, row globals
    down_bytes = experts * HIDDEN * (INTER // 2 + INTER // 16 + 4)
    hs = [torch.empty(tokens * SLOTS, INTER, device=DEVICE) for _ in range(n)]
    outs = [torch.empty(tokens, HIDDEN, device=DEVICE, dtype=DTYPE) for _ in range(n)]
    c, r = copies, routes

    def up(cfg):
        return lambda i: (fp4_moe.gemv_up(r[i]["x"], c[i]["w13"], c[i]["s13"], c[i]["g13"], r[i]["ids"], hs[i],
                                          "silu", cfg), hs[i])[1]

    def down(cfg):
        return lambda i: (fp4_moe.gemv_down(refs[i][0], c[i]["w2"], c[i]["s2"], c[i]["g2"], r[i]["ids"], r[i]["w"],
                                            outs[i], cfg), outs[i])[1]

    def pair(cfg):
        return lambda i: fp4_moe._gemv_moe(r[i]["x"], c[i]["w13"], c[i]["s13"], c[i]["g13"], c[i]["w2"], c[i]["s2"],
                                           c[i]["g2"], r[i]["w"], r[i]["ids"], "silu", cfg)

    bcfg = bf16_moe.gemv_config(tokens, torch.device(DEVICE))  # the bf16 table's pick at this T
    act = bf16_moe._ACTIVATIONS["silu"]
    bf16 = {
        "config": bcfg,
        "up": measure("bf16 up", lambda i: (moe_gemv.gemv_up(r[i]["x"], c[i]["w13b"], r[i]["ids"], hs[i], True, act,
                                                             bcfg), hs[i])[1], n, refs[0][0]),
        "down": measure("bf16 down", lambda i: (moe_gemv.gemv_down(refs[i][0], c[i]["w2b"], r[i]["ids"], r[i]["w"],
                                                                   outs[i], bcfg), outs[i])[1], n, refs[0][1]),
        "pair": measure("bf16 moe_gemv", lambda i: moe_gemv.moe_gemv(
            r[i]["x"], c[i]["w13b"], c[i]["w2b"], r[i]["w"], r[i]["ids"],
            torch.empty(tokens, HIDDEN, device=DEVICE, dtype=DTYPE), True, act, bcfg), n, refs[0][1]),
    }
    cur = current_config(tokens)
    current = {"config": cur, "up": measure("current up", up(cur), n, refs[0][0]),
               "down": measure("current down", down(cur), n, refs[0][1]),
               "pair": measure("current pair", pair(cur), n, refs[0][1])}
    rows = {"up": [], "down": []}
    kinds = {"up": (up_cfg, up, refs[0][0]), "down": (down_cfg, down, refs[0][1])}
    for kind, cand in interleave(UP, DOWN):  # both kernels progress if the deadline comes first
        if time.time() > deadline:
            break
        make, run, want = kinds[kind]
        rows[kind].append({"config": make(cand), **measure(f"T={tokens} {kind} {cand}", run({**cur, **make(cand)}), n,
                                                           want)})
    best = {kind: min((x for x in rows[kind] if x["ok"]), key=lambda x: x["us"], default=None) for kind in rows}
    pick = {kind: best[kind]["config"] for kind in best
            if best[kind] is not None and best[kind]["us"] < (1.0 - min_gain) * current[kind]["us"]}
    chosen = {**cur, **pick.get("up", {}), **pick.get("down", {})}
    best_pair = measure("best pair", pair(chosen), n, refs[0][1]) if pick else current["pair"]
    return {"tokens": tokens, "key": fp4_moe.gemv_config_key(EXPERTS, HIDDEN, INTER, SLOTS, tokens), "experts": experts,
            "up_bytes": up_bytes, "down_bytes": down_bytes, "current": current, "bf16": bf16, "rows": rows,
            "best": best, "pick": pick, "chosen": chosen, "best_pair": best_pair,
            "gemv_path_taken": tokens * SLOTS <= fp4_moe.GEMV_MAX_PAIRS,
            "pdl": pdl_options(torch.device(DEVICE))["PDL"], "complete": time.time() <= deadline}


def line(r: dict) -> str:
    """One line per T: current, best (+ config) and bf16 µs and GB/s of up, down and the pair."""
    gb = lambda nbytes, us: nbytes / (us * 1e3)  # noqa: E731
    parts = []
    for kind, nbytes in (("up", r["up_bytes"]), ("down", r["down_bytes"]), ("pair", r["up_bytes"] + r["down_bytes"])):
        cur, b16 = r["current"][kind], r["bf16"][kind]
        best = r["best_pair"] if kind == "pair" else r["best"][kind]
        best_txt = f"best {best['us']:.1f}us {gb(nbytes, best['us']):.0f}GB/s" if best else "best -"
        if kind != "pair" and best:
            best_txt += f" {list(best['config'].values())}"
        parts.append(f"{kind} cur {cur['us']:.1f}us {gb(nbytes, cur['us']):.0f}GB/s {best_txt} | bf16 {b16['us']:.1f}us")
    bad = [k for k in ("up", "down", "pair") if not r["current"][k]["ok"]]
    wrong = [f"{k} {x['config']}" for k in r["rows"] for x in r["rows"][k] if not x["ok"] and x["err"] is not None]
    return (f"T={r['tokens']} ({r['experts']} experts): " + "; ".join(parts) + (f"; CURRENT WRONG {bad}" if bad else "")
            + (f"; WRONG {wrong}" if wrong else "") + ("" if r["complete"] else " TRUNCATED"))


def write_table(entry: dict, path: Path, command: str, device: str) -> None:
    """Merge ``entry`` into the table at ``path``: other kernels and other keys kept, each swept key updated with
    the new keys only (a key's other kernel's keys kept)."""
    table = json.loads(path.read_text()) if path.exists() else {}
    old = table.get(fp4_moe.GEMV_KERNEL, {})
    comment = (f"bench/fp4_moe_gemv_sweep.py on {device}: `{command}`; keys e{{E}}_h{{H}}_i{{I}}_k{{slots}}_t{{T up to "
               "2^i}; a kernel's keys only where > 3% faster than the previous pick")
    swept = {key: {**old.get(key, {}), **cfg} for key, cfg in entry.items()}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(render(merge(table, {fp4_moe.GEMV_KERNEL: swept}, comment, by_key=True)))
    os.replace(tmp, path)
    print(f"merged {sorted(entry)} into {path}", flush=True)


def merge_result(table_file: Path, table: Path) -> None:
    """--merge: a GPU run's entry into ``table``, stamped with that run's device and command."""
    entry = json.loads(table_file.read_text())[fp4_moe.GEMV_KERNEL]
    run = table_file.with_name("fp4_moe_gemv_sweep.json")
    info = json.loads(run.read_text()) if run.exists() else {}
    if not entry:
        print(f"{table_file}: an empty entry; the table stays as it is")
        return
    write_table(entry, table, " ".join(["python bench/fp4_moe_gemv_sweep.py", *info.get("argv", ["?"])]),
                info.get("device", "unknown GPU"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT"), help="results folder (default $OUT)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: the Triton interpreter")
    parser.add_argument("--tiny", action="store_true", help="tiny experts, two configs a kernel: the plumbing only")
    parser.add_argument("--write", action="store_true", help="merge the entry into the Qwen plugin's tuning/sm_90.json")
    parser.add_argument("--table", type=Path, default=None, help="the table --write merges into")
    parser.add_argument("--min-gain", type=float, default=0.03, help="a kernel's best must beat the current by this")
    parser.add_argument("--deadline-s", type=float, default=240.0, help="the H200 compiles the 120 configs in ~90 s")
    parser.add_argument("--merge", type=Path, help="merge this fp4_moe_gemv_table.json into --table (default: the "
                                                   "Qwen plugin's); no sweep")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--workers", type=int, default=1 if CPU else 12)
    args = parser.parse_args()
    if args.merge:
        merge_result(args.merge, args.table or table_path(QWEN, "sm_90"))
        return
    if not args.out:
        parser.error("--out or $OUT is required")
    if args.write and CPU and args.table is None:
        parser.error("--device cpu --write needs --table: interpreter timings must not reach the package's table")
    start = time.time()
    deadline = start + args.deadline_s
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import triton

    if not CPU and args.workers > 1:
        compile_in_workers(warm_worker, [("up", u) for u in UP] + [("down", d) for d in DOWN], args.workers,
                           0.5 * args.deadline_s)
    copies = [weights(i + 1) for i in range(ROTATE)]
    info = {"device": "cpu-interpreter" if CPU else torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "ARMILLARY_PDL": os.environ.get("ARMILLARY_PDL"),
            "shape": {"experts": EXPERTS, "slots": SLOTS, "hidden": HIDDEN, "inter": INTER}, "rotate": ROTATE,
            "argv": sys.argv[1:]}
    token_counts = [int(t) for t in args.tokens.split(",")]
    print(f"torch {torch.__version__}, triton {triton.__version__}, {info['device']}, PDL "
          f"{pdl_options(torch.device(DEVICE))['PDL']}; {len(UP)} up and {len(DOWN)} down configs; best configs print "
          "as up [BLOCK_N1, BLOCK_K1, num_warps1], down [BLOCK_N2, BLOCK_K2, num_warps2]", flush=True)
    results, entry = [], {}
    for j, tokens in enumerate(token_counts):  # the time left shared evenly by the token counts still to run
        now = time.time()
        results.append(bench_tokens(tokens, copies, now + max(0.0, deadline - now) / (len(token_counts) - j),
                                    args.min_gain))
        print(line(results[-1]), flush=True)
        entry = table_entry(results)
        (out / "fp4_moe_gemv_sweep.json").write_text(json.dumps(
            {**info, "results": results, "table": {fp4_moe.GEMV_KERNEL: entry}, "elapsed_s": time.time() - start,
             "deadline_hit": time.time() > deadline}, indent=1, default=str))
        (out / "fp4_moe_gemv_table.json").write_text(json.dumps({fp4_moe.GEMV_KERNEL: entry}, indent=1))
    print(f'"fp4_moe_gemv" entry ({len(entry)} keys): {json.dumps(entry)}')
    if args.write:
        if not entry:
            print("--write: no pick beats the current one by > 3%; the table stays as it is")
        else:
            write_table(entry, args.table or table_path(QWEN, "sm_90"),
                        " ".join(["python bench/fp4_moe_gemv_sweep.py", *sys.argv[1:]]), info["device"])
    print(f"done in {time.time() - start:.0f} s -> {out / 'fp4_moe_gemv_sweep.json'}")


if __name__ == "__main__":
    main()
