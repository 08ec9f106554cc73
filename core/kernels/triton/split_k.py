"""The output epilogue shared by the skinny GEMM kernels: a tile's store, or its deterministic in-kernel split-K sum.

Contract of ``split_k_epilogue`` (for kernels on a grid (N tiles, M tiles, split_k) whose program
(n, m, s) holds the fp32 tile ``acc`` [BLOCK_N, BLOCK_M] of out rows ``offs_m``, columns ``offs_n``
summed over its K range s):

- ``split_k == 1``: the tile (+ bias) goes straight to ``out`` in out's dtype;
- otherwise each program stores its partial into ``part_ptr`` [split_k, M, N] fp32, then takes a
  ticket (``acq_rel`` atomic add on ``ticket_ptr[m · N tiles + n]``, int32); the last of the
  split_k programs to arrive sums the partials in split order (its own from registers, the others
  with ``.cg`` loads past L1), so the result does not depend on arrival order, writes the tile and
  sets the ticket back to 0. The tickets must be zero at launch and are zero again after it, so a
  captured CUDA graph can replay the kernel without clearing them.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def store_tile(out_ptr, bias_ptr, acc, offs_n, offs_m, n_ok, m_ok, stride_om, HAS_BIAS: tl.constexpr):
    """out[m, n] = acc[n, m] (+ bias[n]) in out's dtype; acc: [BLOCK_N, BLOCK_M] fp32."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


@triton.jit
def split_k_epilogue(
    acc, out_ptr, bias_ptr, part_ptr, ticket_ptr, offs_n, offs_m, n_ok, m_ok, M, N, stride_om,
    pid_n, pid_m, pid_k, split_k, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """Write program (pid_n, pid_m, pid_k)'s tile ``acc`` [BN, BM] fp32 to out, reducing over split_k (module doc)."""
    if split_k == 1:
        store_tile(out_ptr, bias_ptr, acc, offs_n, offs_m, n_ok, m_ok, stride_om, HAS_BIAS)
    else:
        tile_ok = n_ok[:, None] & m_ok[None, :]
        part_off = offs_m[None, :].to(tl.int64) * N + offs_n[:, None]  # [BN, BM] in one [M, N] slice
        split_stride = M.to(tl.int64) * N
        tl.store(part_ptr + pid_k * split_stride + part_off, acc, mask=tile_ok)
        tl.debug_barrier()  # every thread's partial is written before the ticket releases them
        ticket_at = ticket_ptr + pid_m * tl.num_programs(0) + pid_n
        ticket = tl.atomic_add(ticket_at, 1, sem="acq_rel")
        if ticket == split_k - 1:  # the last arriver sums the partials in split order (deterministic)
            total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for s in range(0, split_k):
                if s == pid_k:
                    part = acc
                else:
                    part = tl.load(part_ptr + s * split_stride + part_off, mask=tile_ok, other=0.0,
                                   cache_modifier=".cg")
                total += part
            store_tile(out_ptr, bias_ptr, total, offs_n, offs_m, n_ok, m_ok, stride_om, HAS_BIAS)
            tl.store(ticket_at, 0)  # no other program of this call touches the ticket any more
