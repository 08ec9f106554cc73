"""Micro-benchmark of the Triton paged attention kernels at the Qwen3.6-35B-A3B full-attention shape.

Checks correctness against ``armillary.kernels.attention.paged_attention`` at real sizes, times decode
(eager and inside a CUDA graph; achieved KV bandwidth) and prefill (TFLOP/s over causal pairs), compares
with ``scaled_dot_product_attention`` on contiguous K/V, and sweeps launch configs. CUDA only.

    python bench/attention_kernels.py --out results/ [--deadline 200]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from armillary.forward_batch import KVCache
from armillary.kernels.attention import paged_attention, write_kv
from armillary.kernels.triton import paged_attention as pa
from armillary.kernels.triton.kv_cache import write_kv_cache

HQ, HKV, D, PAGE, DTYPE = 16, 2, 256, 16, torch.bfloat16
DEVICE = "cuda"
SCALE = D**-0.5
DECODE_SWEEP = [
    {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2},
    {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    {"BLOCK_N": 128, "num_warps": 4, "num_stages": 1},
    {"BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
    {"BLOCK_N": 128, "num_warps": 8, "num_stages": 1},
    {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "split_min_tokens": 128},
    {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "split_min_tokens": 512},
    {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "target_waves": 4},
]
PREFILL_SWEEP = [
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
    {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3},
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
    {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2},
    {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 8, "num_stages": 1},
    {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 8, "num_stages": 3},
]


class Recorder:
    """Prints each result and keeps them all in one JSON file, rewritten after every record."""

    def __init__(self, out_dir: Path, deadline_s: float):
        self.path = out_dir / "attention_kernels.json"
        self.rows: list[dict] = []
        self.t0 = time.time()
        self.deadline_s = deadline_s

    def add(self, **row) -> None:
        row["t_s"] = round(time.time() - self.t0, 1)
        self.rows.append(row)
        print(json.dumps(row), flush=True)
        self.path.write_text(json.dumps(self.rows, indent=1))

    def time_left(self, extra_s: float = 0.0) -> bool:
        return time.time() - self.t0 < self.deadline_s + extra_s


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def bench_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


class Workspace:
    """One paged cache large enough for every case; each call hands out fresh shuffled block tables."""

    def __init__(self, max_tokens: int, hkv: int = HKV, d: int = D, page: int = PAGE):
        self.page = page
        self.num_blocks = max_tokens // page + 64
        self.k = torch.randn(self.num_blocks, page, hkv, d, device=DEVICE, dtype=DTYPE)
        self.v = torch.randn(self.num_blocks, page, hkv, d, device=DEVICE, dtype=DTYPE)

    def block_tables(self, seq_lens: list[int]) -> torch.Tensor:
        width = max(-(-n // self.page) for n in seq_lens)
        perm = torch.randperm(self.num_blocks, device=DEVICE)[: len(seq_lens) * width]
        return perm.view(len(seq_lens), width).to(torch.int32)


def capture(call) -> torch.cuda.CUDAGraph:
    """``call`` recorded into a CUDA graph after a warm-up on a side stream (compiles stay outside)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph


def i32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def sdpa_ms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal) -> tuple[str, float | None]:
    """Best of flash / cuDNN SDPA with native GQA on contiguous [B, H, L, D]; (backend, ms) or (error, None)."""
    results = []
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        try:
            with sdpa_kernel(backend):
                def run():
                    if isinstance(causal, bool):
                        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=SCALE, enable_gqa=True)
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal, scale=SCALE, enable_gqa=True)
                run()
                results.append((backend.name, bench_ms(run)))
        except Exception as exc:  # noqa: BLE001 - a yardstick backend may not support the shape
            results.append((f"{backend.name} failed: {str(exc).splitlines()[0][:120]}", None))
    timed = [r for r in results if r[1] is not None]
    if not timed:
        # no native GQA: flash on K/V repeated to Hq heads (reads Hq/Hkv times the bytes)
        group = q.shape[1] // k.shape[1]
        ke, ve = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        try:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                def run_expanded():
                    if isinstance(causal, bool):
                        return F.scaled_dot_product_attention(q, ke, ve, is_causal=causal, scale=SCALE)
                    return F.scaled_dot_product_attention(q, ke, ve, attn_mask=causal, scale=SCALE)
                run_expanded()
                timed.append(("FLASH_ATTENTION on expanded kv", bench_ms(run_expanded)))
        except Exception as exc:  # noqa: BLE001
            results.append((f"expanded failed: {str(exc).splitlines()[0][:120]}", None))
    return min(timed, key=lambda r: r[1]) if timed else (" | ".join(r[0] for r in results), None)


def decode_case(ws: Workspace, rec: Recorder, batch: int, ctx: int, main: bool, sweep: bool) -> None:
    seq_lens = [ctx] * batch
    bt = ws.block_tables(seq_lens)
    sl = i32(seq_lens)
    q = torch.randn(batch, HQ, D, device=DEVICE, dtype=DTYPE)
    ref = paged_attention(q, KVCache(ws.k, ws.v), bt, list(range(batch + 1)), seq_lens, SCALE)
    kv_bytes = sum(seq_lens) * HKV * 2 * D * ws.k.element_size()
    cfg = pa._config("paged_attention_decode", pa.DECODE_DEFAULTS, D, q.device, None)
    splits = pa._num_splits(batch * HKV, bt.shape[1] * PAGE, cfg, q.device)
    out = torch.full_like(q, float("nan"))
    if main:
        decode_main(ws, rec, q, bt, sl, out, ref, kv_bytes, splits)
    if not sweep:
        return
    for override in DECODE_SWEEP:
        if not rec.time_left():
            rec.add(kind="decode_sweep_skipped", batch=batch, ctx=ctx)
            return
        out.fill_(float("nan"))
        fn = lambda: pa.paged_attention_decode(q, ws.k, ws.v, bt, sl, SCALE, out=out, config=override)  # noqa: E731
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - a config may not fit (shared memory, registers)
            rec.add(kind="decode_sweep", batch=batch, ctx=ctx, config=override, error=str(exc)[:200])
            continue
        err = rel_err(out, ref)
        ms = bench_ms(fn)
        rec.add(kind="decode_sweep", batch=batch, ctx=ctx, config=override, rel_err=err, ms=ms,
                GBps=kv_bytes / ms / 1e6)


def decode_main(ws, rec, q, bt, sl, out, ref, kv_bytes: int, splits: int) -> None:
    """Default config: error, eager and graph-replay time, host launch cost, SDPA yardstick."""
    batch, ctx = q.shape[0], int(sl[0])
    call = lambda: pa.paged_attention_decode(q, ws.k, ws.v, bt, sl, SCALE, out=out)  # noqa: E731
    call()
    err = rel_err(out, ref)
    ms = bench_ms(call)
    # CUDA graph: captured once, then replayed
    graph = capture(call)
    graph_ms = bench_ms(graph.replay)
    t0 = time.perf_counter()
    for _ in range(200):
        call()
    host_us = (time.perf_counter() - t0) / 200 * 1e6
    torch.cuda.synchronize()
    # yardstick: SDPA on contiguous K/V of the same length
    kc = torch.randn(batch, HKV, ctx, D, device=DEVICE, dtype=DTYPE)
    vc = torch.randn_like(kc)
    backend, sd_ms = sdpa_ms(q.unsqueeze(2), kc, vc, False)
    del kc, vc
    rec.add(kind="decode", batch=batch, ctx=ctx, splits=splits, rel_err=err, ms=ms, GBps=kv_bytes / ms / 1e6,
            graph_ms=graph_ms, graph_GBps=kv_bytes / graph_ms / 1e6, host_launch_us=host_us,
            sdpa_backend=backend, sdpa_ms=sd_ms, sdpa_GBps=kv_bytes / sd_ms / 1e6 if sd_ms else None)


def decode_graph_reuse(ws: Workspace, rec: Recorder) -> None:
    """A graph captured with a 16K bucket, replayed after seq_lens / block tables change in place."""
    batch = 8
    bt = ws.block_tables([16384] * batch)
    sl = i32([16384] * batch)
    q = torch.randn(batch, HQ, D, device=DEVICE, dtype=DTYPE)
    out = torch.empty_like(q)
    call = lambda: pa.paged_attention_decode(q, ws.k, ws.v, bt, sl, SCALE, max_seq_len=16384, out=out)  # noqa: E731
    graph = capture(call)
    errs = []
    for lens in ([1, 7, 33, 50, 1000, 4097, 16000, 16384], [16384, 3, 9000, 2, 1, 12345, 600, 8]):
        sl.copy_(i32(lens))
        bt.copy_(ws.block_tables([16384] * batch))
        q.normal_()
        graph.replay()
        ref = paged_attention(q, KVCache(ws.k, ws.v), bt, list(range(batch + 1)), lens, SCALE)
        errs.append(rel_err(out, ref))
    rec.add(kind="decode_graph_reuse", rel_errs=errs)


def prefill_case(ws: Workspace, rec: Recorder, query_lens: list[int], seq_lens: list[int], name: str,
                 main: bool, sweep: bool) -> None:
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    bt = ws.block_tables(seq_lens)
    q = torch.randn(qsl[-1], HQ, D, device=DEVICE, dtype=DTYPE)
    ref = paged_attention(q, KVCache(ws.k, ws.v), bt, qsl, seq_lens, SCALE)
    torch.cuda.empty_cache()
    flops = 4 * HQ * D * causal_pairs(query_lens, seq_lens, None)
    qsl_t, sl_t = i32(qsl), i32(seq_lens)
    out = torch.full_like(q, float("nan"))
    if main:
        prefill_main(ws, rec, q, bt, qsl_t, sl_t, query_lens, seq_lens, name, out, ref, flops)
    if not sweep:
        return
    for override in PREFILL_SWEEP:
        if not rec.time_left():
            rec.add(kind="prefill_sweep_skipped", case=name)
            return
        out.fill_(float("nan"))
        fn = lambda: pa.paged_attention_prefill(q, ws.k, ws.v, bt, qsl_t, sl_t, max(query_lens), SCALE,  # noqa: E731
                                                out=out, config=override)
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - a config may not fit (shared memory, registers)
            rec.add(kind="prefill_sweep", case=name, config=override, error=str(exc)[:200])
            continue
        err = rel_err(out, ref)
        ms = bench_ms(fn)
        rec.add(kind="prefill_sweep", case=name, config=override, rel_err=err, ms=ms, TFLOPs=flops / ms / 1e9)


def prefill_main(ws, rec, q, bt, qsl_t, sl_t, query_lens, seq_lens, name, out, ref, flops: int) -> None:
    """Default config: error, time, TFLOP/s; SDPA yardstick for single sequences."""
    call = lambda: pa.paged_attention_prefill(  # noqa: E731
        q, ws.k, ws.v, bt, qsl_t, sl_t, max(query_lens), SCALE, out=out)
    call()
    err = rel_err(out, ref)
    ms = bench_ms(call)
    row = dict(kind="prefill", case=name, query_lens=query_lens[:4], seq_lens=seq_lens[:4], num_seqs=len(seq_lens),
               rel_err=err, ms=ms, TFLOPs=flops / ms / 1e9)
    if len(seq_lens) == 1:
        n, L = query_lens[0], seq_lens[0]
        qd = q.transpose(0, 1).unsqueeze(0).contiguous()  # [1, Hq, n, D]
        kc = torch.randn(1, HKV, L, D, device=DEVICE, dtype=DTYPE)
        vc = torch.randn_like(kc)
        if n == L:
            mask = True
        else:
            mask = causal_lower_right(n, L)
        backend, sd_ms = sdpa_ms(qd, kc, vc, mask)
        row.update(sdpa_backend=backend, sdpa_ms=sd_ms, sdpa_TFLOPs=flops / sd_ms / 1e9 if sd_ms else None)
        del kc, vc
    rec.add(**row)


def kv_write_case(ws: Workspace, rec: Recorder, tokens: int) -> None:
    k = torch.randn(tokens, HKV, D, device=DEVICE, dtype=DTYPE)
    v = torch.randn_like(k)
    slots = torch.randperm(ws.num_blocks * PAGE, device=DEVICE)[:tokens]
    expect = KVCache(ws.k.clone(), ws.v.clone())
    write_kv(expect, k, v, slots)
    write_kv_cache(k, v, ws.k, ws.v, slots)
    same = bool(torch.equal(ws.k, expect.k) and torch.equal(ws.v, expect.v))
    del expect
    ms = bench_ms(lambda: write_kv_cache(k, v, ws.k, ws.v, slots))
    ref_ms = bench_ms(lambda: write_kv(KVCache(ws.k, ws.v), k, v, slots))
    moved = 2 * 2 * k.numel() * k.element_size()  # read + write, K and V
    rec.add(kind="kv_write", tokens=tokens, exact=same, ms=ms, GBps=moved / ms / 1e6, torch_index_put_ms=ref_ms)


OTHER_SHAPES = [
    # name, hq, hkv, d, page, sliding_window, softcap
    ("nemotron 32/2x128", 32, 2, 128, 16, None, None),
    ("gemma3-27b sliding 32/16x128 +cap50", 32, 16, 128, 32, 1024, 50.0),
    ("gemma3-12b sliding 16/8x256", 16, 8, 256, 64, 1024, None),
    ("gemma4 global 32/4x512", 32, 4, 512, 32, None, None),
    ("mha 8/8x64", 8, 8, 64, 32, None, None),
]


def causal_pairs(query_lens: list[int], seq_lens: list[int], window: int | None) -> int:
    """(query, visible key) pairs: query at position p sees min(p + 1, window) keys."""
    total = 0
    for n, L in zip(query_lens, seq_lens):
        p = torch.arange(L - n, L, dtype=torch.int64) + 1
        total += int((p.clamp(max=window) if window else p).sum())
    return total


def other_shape_case(rec: Recorder, name: str, hq: int, hkv: int, d: int, page: int, window, softcap) -> None:
    """Correctness (decode, mixed prefill) and one timing each for another model's attention shape."""
    ws = Workspace(8 * 8192 + 16384, hkv, d, page)
    scale = d**-0.5
    cache = KVCache(ws.k, ws.v)
    row = dict(kind="other_shape", shape=name)
    dec_lens = [1, 777, 5000, 8192]
    bt = ws.block_tables(dec_lens)
    q = torch.randn(len(dec_lens), hq, d, device=DEVICE, dtype=DTYPE)
    out = pa.paged_attention_decode(q, ws.k, ws.v, bt, i32(dec_lens), scale, window, softcap)
    ref = paged_attention(q, cache, bt, list(range(len(dec_lens) + 1)), dec_lens, scale, window, softcap)
    row["decode_rel_err"] = rel_err(out, ref)
    query_lens, seq_lens = [2048, 1, 300], [2048 + 3000, 4000, 300]
    qsl = [0, 2048, 2049, 2349]
    bt = ws.block_tables(seq_lens)
    q = torch.randn(qsl[-1], hq, d, device=DEVICE, dtype=DTYPE)
    out = pa.paged_attention_prefill(q, ws.k, ws.v, bt, i32(qsl), i32(seq_lens), 2048, scale, window, softcap)
    ref = paged_attention(q, cache, bt, qsl, seq_lens, scale, window, softcap)
    row["prefill_rel_err"] = rel_err(out, ref)
    del ref
    # timings: decode batch 8 at 8K, prefill of one 4K prompt
    dec_lens = [8192] * 8
    bt = ws.block_tables(dec_lens)
    q = torch.randn(8, hq, d, device=DEVICE, dtype=DTYPE)
    sl = i32(dec_lens)
    ms = bench_ms(lambda: pa.paged_attention_decode(q, ws.k, ws.v, bt, sl, scale, window, softcap))
    kv_bytes = min(8192, window or 8192) * 8 * hkv * 2 * d * 2
    row.update(decode_b8_8k_ms=ms, decode_b8_8k_GBps=kv_bytes / ms / 1e6)
    bt = ws.block_tables([4096])
    q = torch.randn(4096, hq, d, device=DEVICE, dtype=DTYPE)
    qsl_t, sl_t = i32([0, 4096]), i32([4096])
    ms = bench_ms(lambda: pa.paged_attention_prefill(q, ws.k, ws.v, bt, qsl_t, sl_t, 4096, scale, window, softcap))
    flops = 4 * hq * d * causal_pairs([4096], [4096], window)
    row.update(prefill_4k_ms=ms, prefill_4k_TFLOPs=flops / ms / 1e9)
    rec.add(**row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--deadline", type=float, default=200.0, help="seconds after which sweeps stop")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rec = Recorder(args.out, args.deadline)
    rec.add(kind="env", gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    ws = Workspace(64 * 16384 + 16384)
    for batch, ctx in ((1, 1024), (8, 1024), (64, 1024), (1, 16384), (8, 16384), (64, 16384)):
        decode_case(ws, rec, batch, ctx, main=True, sweep=False)
    decode_graph_reuse(ws, rec)
    prefill_case(ws, rec, [2048], [2048], "2K", main=True, sweep=False)
    prefill_case(ws, rec, [16384], [16384], "16K", main=True, sweep=False)
    prefill_case(ws, rec, [2048], [8192 + 2048], "2K chunk after 8K", main=True, sweep=False)
    prefill_case(ws, rec, [2048] + [1] * 32, [10240] + [4096] * 32, "mixed: 2K chunk + 32 decodes", main=True,
                 sweep=False)
    prefill_case(ws, rec, [4] * 4, [16384] * 4, "4 seqs x 4 queries (spec verify) at 16K", main=True, sweep=False)
    kv_write_case(ws, rec, 16384)
    for shape in OTHER_SHAPES:
        try:
            other_shape_case(rec, *shape)
        except Exception as exc:  # noqa: BLE001 - record and go on to the next shape
            rec.add(kind="other_shape", shape=shape[0], error=str(exc)[:300])
        torch.cuda.empty_cache()
    prefill_case(ws, rec, [16384], [16384], "16K", main=False, sweep=True)
    for batch in (1, 8, 64):
        decode_case(ws, rec, batch, 16384, main=False, sweep=True)
    prefill_case(ws, rec, [2048], [8192 + 2048], "2K chunk after 8K", main=False, sweep=True)


if __name__ == "__main__":
    main()
