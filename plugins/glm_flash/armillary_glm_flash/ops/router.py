"""The MoE router's float32 logits in one Triton launch: x (model dtype) read and widened in the kernel, times
the float32 router weight, float32 out (torch: a cast, then a cuBLAS GEMV / SIMT GEMM).

logits[t, e] = Σ_k float(x[t, k]) · w[e, k], as transformers' ``F.linear(x.float(), w)``: the same
products, summed in another order. A program takes ``BLOCK_E`` experts and ``BLOCK_T`` rows over the
whole K (multiply-adds per lane, one reduction at the end): the [E, K] weight is read once per row
block. Few rows only (``MAX_ROWS``). CUDA-graph safe.

Prefill rows of bf16 x take ``router_logits_mma``: each float32 weight tile is cut in registers into three bf16
parts (hi + mid + lo carry all 24 mantissa bits) and x · w is three tensor-core dots into one float32 accumulator.
bf16 × bf16 products are exact in float32, so the sum differs from the float32 GEMM only in rounding order.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from armillary.kernels.triton.host import cdiv, next_power_of_2
from armillary.kernels.tuning import kernel_config

PACKAGE = "armillary_glm_flash"
MAX_ROWS = 64
DEFAULTS = {"BLOCK_E": 2, "BLOCK_K": 512, "num_warps": 4, "num_stages": 2}
MMA_DEFAULTS = {"min_rows": MAX_ROWS + 1, "BLOCK_T": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}
MMA_LONG_ROWS = 4096  # row counts above this take the tables' ``_long`` entry (bigger row tiles fill the GPU)


@triton.jit
def logits_tile(x_ptr, w_ptr, offs_t, offs_e, t_ok, e_ok, K, stride_xt, stride_we,
                BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows ``offs_t`` x experts ``offs_e`` of the float32 logits: [BLOCK_T, BLOCK_E] (also ``router_topk``'s, so
    both launches give the same bits for the same block sizes)."""
    offs_k = tl.arange(0, BLOCK_K)
    wide = tl.zeros([BLOCK_T, BLOCK_E, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        x = tl.load(x_ptr + offs_t[:, None] * stride_xt + k[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + offs_e[:, None] * stride_we + k[None, :], mask=e_ok[:, None] & k_ok[None, :], other=0.0)
        wide += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]  # [BT, BE, BK]
    return tl.sum(wide, axis=2)  # [BT, BE]


@triton.jit
def _router_logits_kernel(x_ptr, w_ptr, out_ptr, rows, E, K, stride_xt, stride_we, stride_ot,
                          BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """Grid (expert blocks, row blocks): out [T, E] float32."""
    offs_e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    e_ok = offs_e < E
    t_ok = offs_t < rows
    acc = logits_tile(x_ptr, w_ptr, offs_t, offs_e, t_ok, e_ok, K, stride_xt, stride_we, BLOCK_T, BLOCK_E, BLOCK_K)
    tl.store(out_ptr + offs_t[:, None] * stride_ot + offs_e[None, :], acc, mask=t_ok[:, None] & e_ok[None, :])


@triton.jit
def _router_logits_mma_kernel(x_ptr, w_ptr, out_ptr, rows, E, K, stride_xt, stride_we, stride_ot,
                              BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """Grid (row blocks, expert blocks): out [T, E] float32 from x and the float32 weight split three ways into
    x's dtype (bf16 on the model path; fp16 too, for the CPU interpreter, whose bf16 ``tl.dot`` is wrong)."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_k = tl.arange(0, BLOCK_K)
    t_ok = offs_t < rows
    e_ok = offs_e < E
    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        x = tl.load(x_ptr + offs_t[:, None] * stride_xt + k[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + k[:, None] + offs_e[None, :] * stride_we, mask=k_ok[:, None] & e_ok[None, :],
                    other=0.0)  # [BK, BE] float32
        hi = w.to(x.dtype)
        rest = w - hi.to(tl.float32)  # exact: w's bits below hi's
        mid = rest.to(x.dtype)
        lo = (rest - mid.to(tl.float32)).to(x.dtype)
        acc = tl.dot(x, lo, acc)  # the small parts first: less rounding in the accumulator
        acc = tl.dot(x, mid, acc)
        acc = tl.dot(x, hi, acc)
    tl.store(out_ptr + offs_t[:, None] * stride_ot + offs_e[None, :], acc, mask=t_ok[:, None] & e_ok[None, :])


def router_config(num_experts: int, hidden: int, rows: int, device: torch.device) -> dict:
    """Launch config: defaults, then the tuning tables' ``router_logits`` entry for this shape and rows
    (rounded up to a power of two)."""
    key = f"e{num_experts}_k{hidden}_m{next_power_of_2(max(rows, 1))}"
    return kernel_config(PACKAGE, "router_logits", key, DEFAULTS, device)


def logits_blocks(cfg: dict, rows: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_E, BLOCK_K) of a logits launch from its config."""
    block_t = min(next_power_of_2(rows), 4)  # [BT, BE, BK] products stay within a few registers a lane
    return block_t, cfg["BLOCK_E"], min(cfg["BLOCK_K"], next_power_of_2(k))


def router_logits_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The naive float32 product: x [T, K] (any float dtype), weight [E, K] -> [T, E] float32."""
    return x.float() @ weight.float().t()


def router_logits(x: torch.Tensor, weight: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """x [T, K] (unit last stride, T <= ``MAX_ROWS``), weight [E, K] float32 (unit last stride) -> [T, E] float32."""
    rows, k = x.shape
    experts = weight.shape[0]
    if weight.shape[1] != k or x.stride(1) != 1 or weight.stride(1) != 1 or weight.dtype != torch.float32:
        raise ValueError(f"router_logits: x {tuple(x.shape)} / weight {tuple(weight.shape)} {weight.dtype} do not fit")
    if rows > MAX_ROWS:
        raise ValueError(f"router_logits: {rows} rows, at most {MAX_ROWS} (prefill takes torch)")
    out = torch.empty(rows, experts, dtype=torch.float32, device=x.device)
    if rows == 0:
        return out
    cfg = dict(router_config(experts, k, rows, x.device) if config is None else config)
    block_t, block_e, block_k = logits_blocks(cfg, rows, k)
    grid = (cdiv(experts, block_e), cdiv(rows, block_t))
    _router_logits_kernel[grid](x, weight, out, rows, experts, k, x.stride(0), weight.stride(0), out.stride(0),
                                BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=block_k, num_warps=cfg["num_warps"],
                                num_stages=cfg["num_stages"])
    return out


def mma_config(num_experts: int, hidden: int, rows: int, device: torch.device) -> dict:
    """Launch config of ``router_logits_mma``: defaults, then the tuning tables' ``router_logits_mma`` entry for
    this shape, ``_short`` (at most ``MMA_LONG_ROWS`` rows) or ``_long``. ``min_rows``: fewer rows take torch."""
    span = "long" if rows > MMA_LONG_ROWS else "short"
    return kernel_config(PACKAGE, "router_logits_mma", f"e{num_experts}_k{hidden}_{span}", MMA_DEFAULTS, device)


def router_logits_mma(x: torch.Tensor, weight: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """x [T, K] bf16 (unit last stride), weight [E, K] float32 (unit last stride) -> [T, E] float32; any T.
    fp16 x is taken too, but its three parts lose the weight's low bits to fp16's range: the model keeps bf16."""
    rows, k = x.shape
    experts = weight.shape[0]
    if (x.dtype not in (torch.bfloat16, torch.float16) or weight.shape[1] != k or x.stride(1) != 1 or weight.stride(1) != 1
            or weight.dtype != torch.float32):
        raise ValueError(f"router_logits_mma: x {tuple(x.shape)} {x.dtype} / weight {tuple(weight.shape)} "
                         f"{weight.dtype} do not fit (bf16 / fp16 x, float32 weight)")
    out = torch.empty(rows, experts, dtype=torch.float32, device=x.device)
    if rows == 0:
        return out
    cfg = mma_config(experts, k, rows, x.device) if config is None else config
    block_e = max(16, min(next_power_of_2(experts), 128))  # tensor-core tiles are at least 16 wide
    block_k = max(16, min(cfg["BLOCK_K"], next_power_of_2(k)))
    grid = (cdiv(rows, cfg["BLOCK_T"]), cdiv(experts, block_e))
    _router_logits_mma_kernel[grid](x, weight, out, rows, experts, k, x.stride(0), weight.stride(0), out.stride(0),
                                    BLOCK_T=cfg["BLOCK_T"], BLOCK_E=block_e, BLOCK_K=block_k,
                                    num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out
