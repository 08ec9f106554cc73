"""Host cost of one launch on this machine (GPU): Triton's launcher against its compiled kernel called directly,
torch's allocator, a tiny cuBLAS GEMM, and core's own kernel wrappers at one-row sizes.

Every kernel here is tiny, so a loop of launches is bound by the host: µs per call = host cost per launch. An
eager prefill step makes ~1,300 launches, so each µs here is ~1.3 ms of a short prompt's TTFT.

    python bench/launch_overhead.py [--calls 3000]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

RESULTS: dict[str, float] = {}


def report(name: str, us: float, note: str = "") -> None:
    RESULTS[name] = us
    print(f"{name}: {us:.2f} us per call {note}".rstrip(), flush=True)


def host_us(fn, calls: int, wait: bool = True) -> float:
    """µs per call of ``fn`` over ``calls`` calls, the GPU drained before; with ``wait`` the timing includes
    draining it after (wall time per call), without it only the host's queueing (the GPU may lag behind)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    if wait:
        torch.cuda.synchronize()
    dt = time.perf_counter() - t
    torch.cuda.synchronize()
    return dt / calls * 1e6


@triton.jit
def _touch(a, b, c, d, e, f, n0, n1, n2, n3, n4, n5, BLOCK: tl.constexpr, FLAG: tl.constexpr):
    """Six pointers, six ints, two constexprs (a typical wrapper's argument list); writes one value."""
    if tl.program_id(0) == 0 and FLAG:
        tl.store(a, (n0 + n1 + n2 + n3 + n4 + n5).to(tl.float32))


def triton_paths(dev: torch.device, calls: int) -> None:
    bufs = [torch.zeros(64, device=dev) for _ in range(6)]
    ints = (3, 64, 2048, 17, 1, 4096)
    grid = (1,)
    report("triton launch, 6 ptr + 6 int args", host_us(lambda: _touch[grid](*bufs, *ints, BLOCK=64, FLAG=True), calls))
    try:
        report("triton launch with launch_pdl", host_us(
            lambda: _touch[grid](*bufs, *ints, BLOCK=64, FLAG=True, launch_pdl=True), calls))
    except Exception as exc:  # noqa: BLE001 - a Triton without the option
        print(f"launch_pdl: {type(exc).__name__}: {exc}", flush=True)
    kernel = _touch[grid](*bufs, *ints, BLOCK=64, FLAG=True)
    stream = torch.cuda.current_stream(dev).cuda_stream
    args = (*bufs, *ints, 64, True)
    try:
        def direct():
            kernel.run(1, 1, 1, stream, kernel.function, kernel.packed_metadata, None, None, None, *args)
        direct()
        torch.cuda.synchronize()
        if bufs[0][0].item() != float(sum(ints)):
            raise RuntimeError(f"direct launch wrote {bufs[0][0].item()}")
        report("compiled kernel .run directly", host_us(direct, calls))
        report("  + stream lookup per call", host_us(lambda: (torch.cuda.current_stream(dev).cuda_stream, direct()), calls))
    except Exception as exc:  # noqa: BLE001 - the launcher's signature differs in this Triton
        print(f"direct run: {type(exc).__name__}: {exc}", flush=True)
    report("  6 x data_ptr()", host_us(lambda: [b.data_ptr() for b in bufs], calls))
    launcher_parts(dev, bufs, ints, calls)


def launcher_parts(dev: torch.device, bufs: list, ints: tuple, calls: int) -> None:
    """The steps of ``JITFunction.run`` one by one (Triton's internals: a step this Triton lacks is skipped)."""
    from triton.runtime import driver

    steps = {
        "driver current device": lambda: driver.active.get_current_device(),
        "driver current stream": lambda: driver.active.get_current_stream(0),
        "torch._C._cuda_getCurrentRawStream": lambda: torch._C._cuda_getCurrentRawStream(0),
    }
    try:
        binder = _touch.device_caches[0][-1]  # (kernel cache, ..., backend, binder) per device
        steps["binder (bind + specialize)"] = lambda: binder(*bufs, *ints, BLOCK=64, FLAG=True)
        _, spec, opts = binder(*bufs, *ints, BLOCK=64, FLAG=True)
        steps["str(specialization) + str(options)"] = lambda: (tuple(spec), str(opts))
    except Exception as exc:  # noqa: BLE001 - internals differ in this Triton
        print(f"binder: {type(exc).__name__}: {exc}", flush=True)
    kernel = _touch[(1,)](*bufs, *ints, BLOCK=64, FLAG=True)
    steps["kernel.launch_metadata"] = lambda: kernel.launch_metadata((1,), 0, *bufs, *ints, 64, True)
    for name, fn in steps.items():
        try:
            report(f"  {name}", host_us(fn, calls))
        except Exception as exc:  # noqa: BLE001
            print(f"  {name}: {type(exc).__name__}: {exc}", flush=True)


def torch_paths(dev: torch.device, calls: int) -> None:
    report("torch.empty [64, 2048] bf16", host_us(lambda: torch.empty(64, 2048, device=dev, dtype=torch.bfloat16), calls))
    x = torch.randn(1, 64, device=dev, dtype=torch.bfloat16)
    w = torch.randn(64, 64, device=dev, dtype=torch.bfloat16)
    report("F.linear [1, 64] x [64, 64] (cuBLAS)", host_us(lambda: torch.nn.functional.linear(x, w), calls))
    report("tensor.view + split", host_us(lambda: x.view(1, 2, 32).split([16, 16], dim=-1), calls))
    report("torch.cuda.current_stream()", host_us(lambda: torch.cuda.current_stream(dev), calls))
    report("os.environ.get", host_us(lambda: os.environ.get("ARMILLARY_PDL", ""), calls))
    report("triton.cdiv (host)", host_us(lambda: triton.cdiv(2048, 64), calls))
    report("triton.next_power_of_2 (host)", host_us(lambda: triton.next_power_of_2(2000), calls))
    report("torch.cuda.current_device()", host_us(lambda: torch.cuda.current_device(), calls))


def blas_paths(dev: torch.device) -> None:
    """Host cost of prefill-sized cuBLAS GEMMs under each BLAS backend torch offers (device time beside it)."""
    from torch.nn import functional as F

    w = torch.randn(12352, 2048, device=dev, dtype=torch.bfloat16)
    backend = torch.backends.cuda.preferred_blas_library()
    print(f"preferred BLAS library: {backend}", flush=True)
    for lib in ("cublas", "cublaslt"):
        try:
            torch.backends.cuda.preferred_blas_library(lib)
        except Exception as exc:  # noqa: BLE001
            print(f"{lib}: {type(exc).__name__}: {exc}", flush=True)
            continue
        for m in (64, 2048):
            x = torch.randn(m, 2048, device=dev, dtype=torch.bfloat16)
            name = f"F.linear [{m}, 2048] x [12352, 2048]"
            report(f"{name} host, {lib}", host_us(lambda: F.linear(x, w), 200, wait=False))
            report(f"{name} wall, {lib}", host_us(lambda: F.linear(x, w), 200))
    torch.backends.cuda.preferred_blas_library(backend)


def core_wrappers(dev: torch.device, calls: int) -> None:
    from armillary.kernels.triton import norm, skinny_gemm

    h = 2048
    x = torch.randn(1, h, device=dev, dtype=torch.bfloat16)
    r = torch.randn(1, h, device=dev, dtype=torch.bfloat16)
    wn = torch.ones(h, device=dev, dtype=torch.bfloat16)
    report("core rms_norm (1 row)", host_us(lambda: norm.rms_norm(x, wn, 1e-6), calls))
    report("core fused_add_rms_norm (1 row)", host_us(lambda: norm.fused_add_rms_norm(x, r, wn, 1e-6), calls))
    w = torch.randn(256, h, device=dev, dtype=torch.bfloat16)
    report("core skinny_gemm (1 x 2048 -> 256)", host_us(lambda: skinny_gemm.skinny_gemm(x, w), calls))
    from armillary.kernels.triton import pdl

    report("  pdl.launch_options", host_us(lambda: pdl.launch_options(dev), calls))
    report("  norm.launch_config", host_us(lambda: norm.launch_config(2048, dev), calls))
    report("  torch.empty(x.shape, like x)", host_us(lambda: torch.empty(x.shape, dtype=x.dtype, device=x.device), calls))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=3000)
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name(dev)}", flush=True)
    triton_paths(dev, args.calls)
    torch_paths(dev, args.calls)
    blas_paths(dev)
    try:
        core_wrappers(dev, args.calls)
    except Exception as exc:  # noqa: BLE001 - report the rest even if a wrapper's signature moved
        print(f"core wrappers: {type(exc).__name__}: {exc}", flush=True)
    from triton import knobs

    hooks = {name: getattr(knobs.runtime, name, None) for name in ("launch_enter_hook", "launch_exit_hook")}
    registered = {name: getattr(hook, "calls", hook) for name, hook in hooks.items()}  # HookChain from Triton 3.6
    print(f"Triton launch hooks registered: {registered}", flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "launch_overhead.json").write_text(json.dumps(RESULTS, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
