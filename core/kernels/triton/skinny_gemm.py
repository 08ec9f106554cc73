"""Skinny GEMM ``y = x @ W^T (+ b)`` for few rows (decode projections): the cost is streaming W once.

x: [M, K] with M a handful of decode tokens, W: [N, K] (nn.Linear's [out, in], K contiguous).
Programs tile N finely (BLOCK_N rows of W each) so that every SM has several tiles' loads in
flight; shapes with few N tiles also split K (``split_k`` programs per tile). Two inner products:

* ``fma``: CUDA-core multiply-adds, no MMA padding. One row (M = 1) accumulates ``w * x`` per
  element and reduces once at the end; a few rows reduce each K step over a [BN, BM, BK] product.
* ``dot``: ``tl.dot`` with the rows padded to an MMA tile (BLOCK_M >= 16).

Split K is deterministic: each program writes its fp32 partial to a workspace, takes a ticket
(``atomic_add``, acq_rel), and the last arriver of a tile sums the partials in split order, adds
the bias, stores, and resets the tile's ticket to 0 so the next call (or a CUDA-graph replay)
starts from zero. The tickets are the device's shared ``ticket_buffer``, so calls must not run
concurrently on two streams (the engine runs one). Nothing syncs with the host and the grid
follows the shapes, so the wrapper is CUDA-graph capturable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from armillary.kernels import tuning
from armillary.kernels.triton.device_buffers import ticket_buffer
from armillary.kernels.triton.host import cdiv, next_power_of_2
from armillary.kernels.triton.pdl import launch_options, pdl_launch_dependents, pdl_wait, prefetch_rows_l2
from armillary.kernels.triton.split_k import split_k_epilogue

TUNING_PACKAGE = "armillary.kernels"
KERNEL = "skinny_gemm"
# "use": whether ops.linear picks this kernel over cuBLAS ("auto" backend); "max_rows": the most
# rows it serves; "path": fma | dot | auto (fma for one row); BLOCK_M 0: the rows, rounded up;
# split_k 0: enough splits for ``target_waves`` programs per SM; "preload" (optional, one row): each program's
# whole weight tile loaded before the PDL wait (BLOCK_K widened to its K range). Tables hold 2-byte dtype configs.
DEFAULTS = {
    "use": False, "max_rows": 8, "path": "auto", "BLOCK_M": 0, "BLOCK_N": 16, "BLOCK_K": 256,
    "split_k": 0, "target_waves": 2, "num_warps": 4, "num_stages": 1,
}  # fmt: skip
_MAX_SPLITS = 32


@triton.jit
def _load_tiles(w_ptrs, x_ptrs, k_left, offs_k, n_ok, m_ok, EVEN_K: tl.constexpr):
    """One K step's tiles: w [BN, BK] and x [BM, BK], masked past N, M (and K unless EVEN_K)."""
    if EVEN_K:
        w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
    else:
        k_ok = offs_k < k_left
        w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
    return w, x


@triton.jit(do_not_specialize=["M", "blocks_per_split", "split_k"])
def _skinny_gemm_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, ticket_ptr,
    M, N, K, stride_xm, stride_wn, stride_om, blocks_per_split, split_k,
    HAS_BIAS: tl.constexpr, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
    PRELOAD: tl.constexpr,
):  # fmt: skip
    """Grid (N tiles, M tiles, split_k): program (n, m, s) computes out tile (m, n) over K range s.

    Split s covers K blocks [s, s + 1) * blocks_per_split; EVEN_K: K is a multiple of BLOCK_K (no K masks).
    part_ptr: [split_k, M, N] fp32 partials; ticket_ptr: [M tiles * N tiles] int32, all 0 between calls.
    PRELOAD (one row, blocks_per_split 1): the program's weight tile is loaded before the PDL wait.
    """
    pdl_launch_dependents(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    m_ok = offs_m < M
    k_lo = pid_k * blocks_per_split * BLOCK_K  # a multiple of BLOCK_K the compiler can see: vector loads
    k_hi = tl.minimum(k_lo + blocks_per_split * BLOCK_K, K)
    if PREFETCH:  # the weights are not the previous kernel's: ask for them before waiting
        prefetch_rows_l2(w_ptr, tl.minimum(offs_n, N - 1), stride_wn, k_lo, k_hi, BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]  # [BN, BK]
    if PRELOAD:  # static weights: in registers while the previous kernel ends
        if EVEN_K:
            w_pre = tl.load(w_ptrs + k_lo, mask=n_ok[:, None], other=0.0)
        else:
            w_pre = tl.load(w_ptrs + k_lo, mask=n_ok[:, None] & (offs_k < K - k_lo)[None, :], other=0.0)
    pdl_wait(PDL)
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]  # [BM, BK]
    if USE_DOT:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            w, x = _load_tiles(w_ptrs + k0, x_ptrs + k0, K - k0, offs_k, n_ok, m_ok, EVEN_K)
            acc = tl.dot(w, tl.trans(x), acc, input_precision=DOT_PRECISION)  # [BN, BM]
    elif PRELOAD:  # one row, one K block
        x = tl.load(x_ptr + pid_m.to(tl.int64) * stride_xm + k_lo + offs_k, mask=offs_k < K - k_lo, other=0.0)
        acc = tl.sum(w_pre.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)[:, None]  # [BN, 1]
    elif BLOCK_M == 1:
        # one row: per-lane products summed over the K loop, one cross-lane reduction at the end
        wide = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        x_row = x_ptr + pid_m.to(tl.int64) * stride_xm + offs_k  # [BK]
        for k0 in range(k_lo, k_hi, BLOCK_K):
            if EVEN_K:
                w = tl.load(w_ptrs + k0, mask=n_ok[:, None], other=0.0)
                x = tl.load(x_row + k0)
            else:
                k_ok = offs_k < K - k0
                w = tl.load(w_ptrs + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                x = tl.load(x_row + k0, mask=k_ok, other=0.0)
            wide += w.to(tl.float32) * x.to(tl.float32)[None, :]
        acc = tl.sum(wide, axis=1)[:, None]  # [BN, 1]
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            w, x = _load_tiles(w_ptrs + k0, x_ptrs + k0, K - k0, offs_k, n_ok, m_ok, EVEN_K)
            prod = w.to(tl.float32)[:, None, :] * x.to(tl.float32)[None, :, :]  # [BN, BM, BK]
            acc += tl.sum(prod, axis=2)

    split_k_epilogue(acc, out_ptr, bias_ptr, part_ptr, ticket_ptr, offs_n, offs_m, n_ok, m_ok, M, N, stride_om,
                     pid_n, pid_m, pid_k, split_k, HAS_BIAS, BLOCK_N, BLOCK_M)


def skinny_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The naive fp32 product: x [M, K], weight [N, K], bias [N] -> [M, N] float32."""
    y = x.float() @ weight.float().t()
    return y if bias is None else y + bias.float()


def config_key(rows: int, n: int, k: int) -> str:
    """Tuning-table key: exact (N, K) and the rows rounded up to a power of two."""
    return f"n{n}_k{k}_m{next_power_of_2(max(rows, 1))}"


def lookup_config(rows: int, n: int, k: int, device: torch.device | None = None) -> dict:
    """The defaults overlaid with the target's "default" entry and the (N, K, rows) entry."""
    return tuning.kernel_config(TUNING_PACKAGE, KERNEL, config_key(rows, n, k), DEFAULTS, device)


def serves(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, require_win: bool) -> dict | None:
    """The launch config when the kernel takes ``linear(x, weight, bias)``, else None (use torch).

    It takes 2-D x of at most ``max_rows`` rows, weight [N, K] in x's dtype (both with unit column
    stride), and (when
    ``require_win``, the "auto" backend) only shapes the target's table marks ``"use": true``.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[0] == 0 or x.shape[1] != weight.shape[1]:
        return None
    if weight.dtype != x.dtype or weight.stride(1) != 1 or x.stride(1) != 1:
        return None
    if bias is not None and (bias.dtype != x.dtype or bias.shape != (weight.shape[0],) or not bias.is_contiguous()):
        return None
    cfg = lookup_config(x.shape[0], weight.shape[0], weight.shape[1], x.device)
    if x.shape[0] > cfg["max_rows"] or (require_win and not cfg["use"]):
        return None
    return cfg


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter: no point splitting for occupancy
    return torch.cuda.get_device_properties(device).multi_processor_count


def _launch_shape(cfg: dict, rows: int, n: int, k: int, element_size: int, device: torch.device) -> dict:
    """Block sizes, path and split count of one launch from its (merged) config."""
    use_dot = cfg["path"] == "dot" or (cfg["path"] == "auto" and rows > 1)
    block_m = cfg["BLOCK_M"] or min(next_power_of_2(rows), 16)
    block_n, block_k = cfg["BLOCK_N"], cfg["BLOCK_K"]
    if element_size > 2:  # same bytes per tile as the 2-byte configs the tables hold
        block_k = max(16, block_k * 2 // element_size)
    if use_dot:  # tl.dot needs every dim >= 16
        block_m, block_n, block_k = max(block_m, 16), max(block_n, 16), max(block_k, 16)
    block_k = min(block_k, max(16, next_power_of_2(k)))
    tiles = cdiv(n, block_n) * cdiv(rows, block_m)
    k_blocks = cdiv(k, block_k)
    split = cfg["split_k"]
    if not split:  # enough programs for target_waves per SM, each keeping >= 2 K blocks
        want = cfg["target_waves"] * _sm_count(device)
        split = 1
        while tiles * split * 2 <= want and split * 4 <= k_blocks:
            split *= 2
    split = max(1, min(split, k_blocks, _MAX_SPLITS))
    blocks_per_split = cdiv(k_blocks, split)
    split = cdiv(k_blocks, blocks_per_split)  # no empty splits
    preload = bool(cfg.get("preload", False)) and not use_dot and block_m == 1
    if preload and blocks_per_split > 1:  # one K block a program: BLOCK_K widened to the split's range
        block_k = next_power_of_2(cdiv(k, split))
        blocks_per_split, split = 1, cdiv(k, block_k)
    return dict(USE_DOT=use_dot, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, split_k=split,
                blocks_per_split=blocks_per_split, tiles=tiles, PRELOAD=preload)


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``: x [M, K], weight [N, K] (unit column strides), bias [N] -> [M, N].

    fp32 accumulation, output in x's dtype (or into ``out`` [M, N], unit column stride).
    ``config`` overrides keys of the tuning-table entry (benchmarks); launches without host syncs.
    """
    rows, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"skinny_gemm: x {tuple(x.shape)} / weight {tuple(weight.shape)} layouts do not fit")
    if config is not None and config.keys() >= DEFAULTS.keys():  # a whole config (ops.linear's lookup)
        cfg = config
    else:
        cfg = {**lookup_config(rows, n, k, x.device), **(config or {})}
    launch = _launch_shape(cfg, rows, n, k, x.element_size(), x.device)
    if out is None:
        out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    elif out.shape != (rows, n) or out.stride(1) != 1:
        raise ValueError(f"skinny_gemm: out {tuple(out.shape)} must be [{rows}, {n}] with unit column stride")
    split = launch["split_k"]
    tickets = ticket_buffer(x.device, launch["tiles"])  # untouched without a split
    # the split branch is compiled whatever split_k is: it gets fp32 / int32 pointers either way
    part = torch.empty(split if split > 1 else 1, rows, n if split > 1 else 1, dtype=torch.float32,
                       device=x.device)
    grid = (cdiv(n, launch["BLOCK_N"]), cdiv(rows, launch["BLOCK_M"]), split)
    _skinny_gemm_kernel[grid](
        x, weight, bias if bias is not None else out, out, part, tickets,
        rows, n, k, x.stride(0), weight.stride(0), out.stride(0), launch["blocks_per_split"], split,
        HAS_BIAS=bias is not None, USE_DOT=launch["USE_DOT"],
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", EVEN_K=k % launch["BLOCK_K"] == 0,
        BLOCK_M=launch["BLOCK_M"], BLOCK_N=launch["BLOCK_N"], BLOCK_K=launch["BLOCK_K"], PRELOAD=launch["PRELOAD"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch_options(x.device, prefetch="weights"),
    )  # fmt: skip
    return out
