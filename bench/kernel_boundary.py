"""What a kernel boundary costs inside a decode step: a chain of dependent GEMVs in one CUDA graph.

    python bench/kernel_boundary.py                  # GPU (sm_90 for the PDL variants)
    python bench/kernel_boundary.py --layers 40 --n 2048 --k 2048 --rows 8

A batch-1 decode step is ~400 kernels in a row, each reading its weights and the previous kernel's small output.
This times ``--layers`` such GEMVs (y_i = W_i · y_(i-1), bf16 W_i [N, K] each, all of them larger than L2
together) in one graph, per variant, against one kernel streaming the same bytes:

- ``plain``: no PDL; each kernel starts when the one before has ended.
- ``pdl``: launch_dependents + wait at the top (what the decode kernels do today).
- ``pdl_l2``: an L2 prefetch hint of the program's weight rows before the wait (``ARMILLARY_L2_PREFETCH``).
- ``pdl_regs``: the program's weight rows loaded into registers before the wait, x after it.
- ``one_kernel``: every layer's rows in one launch (x fixed): the bytes at streaming speed, no boundaries.

Each chained variant's output is checked against ``plain`` (the same sums). Per kernel: µs, and the boundary cost
``(chain - one_kernel) / layers``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from armillary.kernels.triton.pdl import gdc_launch_dependents, gdc_wait, prefetch_l2  # noqa: E402

VARIANTS = ("plain", "pdl", "pdl_l2", "pdl_regs")


@triton.jit
def _gemv_kernel(w_ptr, x_ptr, y_ptr, K, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, MODE: tl.constexpr):
    """y[rows] = W[rows, :] · x for this program's ROWS rows (K a multiple of BLOCK_K). MODE 0 plain, 1 PDL wait at
    the top, 2 L2 hints before the wait, 3 the whole weight tile in registers before the wait."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows[:, None].to(tl.int64) * K
    if MODE > 0:
        gdc_launch_dependents()
    if MODE == 2:
        for k0 in range(0, K, BLOCK_K):
            prefetch_l2(w_rows + k0 + tl.arange(0, BLOCK_K // 64)[None, :] * 64)
    if MODE == 3:  # K == BLOCK_K here: the tile is the whole row block
        w = tl.load(w_rows + cols[None, :])
        gdc_wait()
        x = tl.load(x_ptr + cols)
        acc = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    else:
        if MODE > 0:
            gdc_wait()
        acc = tl.zeros([ROWS], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            w = tl.load(w_rows + k0 + cols[None, :])
            x = tl.load(x_ptr + k0 + cols)
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(y_ptr + rows, acc.to(y_ptr.dtype.element_ty))


def chain(ws: list[torch.Tensor], x0: torch.Tensor, ys: list[torch.Tensor], rows: int, mode: int) -> None:
    n, k = ws[0].shape
    pdl = {"launch_pdl": True} if mode > 0 else {}
    x = x0
    for w, y in zip(ws, ys):
        _gemv_kernel[(n // rows,)](w, x, y, k, ROWS=rows, BLOCK_K=k if mode == 3 else min(k, 512), MODE=mode,
                                   num_warps=4, **pdl)
        x = y


def graph_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        fn()
        with torch.cuda.graph(g, stream=s):
            fn()
    torch.cuda.synchronize()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # past L2 between replays
    times = []
    for _ in range(30):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=8, help="weight rows per program")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("kernel_boundary: GPU only")
        return 0
    torch.manual_seed(0)
    n, k, layers = args.n, args.k, args.layers
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(layers)]
    x0 = torch.randn(k, device="cuda", dtype=torch.bfloat16)
    outs = {}
    mb = n * k * 2 / 1e6
    print(f"{torch.cuda.get_device_name()}: {layers} GEMVs of [{n}, {k}] bf16 ({mb:.1f} MB each), {args.rows} rows "
          f"a program, {n // args.rows} programs", flush=True)
    big = torch.cat(ws)  # [layers · N, K]
    y_big = torch.empty(layers * n, device="cuda", dtype=torch.bfloat16)
    one = graph_us(lambda: _gemv_kernel[(layers * n // args.rows,)](big, x0, y_big, k, ROWS=args.rows,
                                                                     BLOCK_K=min(k, 512), MODE=0, num_warps=4))
    print(f"one_kernel: {one:.1f} us ({layers * mb / one:.2f} TB/s), {one / layers:.2f} us a layer's bytes", flush=True)
    for mode, name in enumerate(VARIANTS):
        if mode > 0 and torch.cuda.get_device_capability()[0] < 9:
            continue
        ys = [torch.empty(n, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
        try:
            t = graph_us(lambda: chain(ws, x0, ys, args.rows, mode))
        except Exception as exc:  # a variant that does not compile at these sizes (registers) is reported, not fatal
            print(f"{name}: failed ({type(exc).__name__}: {str(exc)[:120]})", flush=True)
            continue
        outs[name] = ys[-1].float()
        diff = (outs[name] - outs["plain"]).abs().max().item()
        print(f"{name}: {t:.1f} us, {t / layers:.2f} us a kernel ({layers * mb / t:.2f} TB/s), boundary "
              f"{(t - one) / layers:.2f} us; max diff vs plain {diff:.2e}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
