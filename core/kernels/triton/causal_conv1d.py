"""Depthwise causal conv1d (+ SiLU) over packed variable-length sequences in Triton (GDN and Mamba-2 prefill).

Each sequence continues from the last ``kernel - 1`` inputs kept in ``conv_states[slot]`` and
leaves its own last ``kernel - 1`` inputs there. A program owns ``BLOCK_T`` tokens of one sequence
and ``BLOCK_C`` channels; the program holding a sequence's first tokens is the only one that reads
the old window, so it also writes the new one (after a barrier). The chunk table is built on the
host from ``cu_seqlens`` once per call. Reference: ``armillary.kernels.conv1d.causal_conv1d_varlen``.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from armillary.kernels.triton.host import cdiv, next_power_of_2
from armillary.kernels.tuning import kernel_config
from armillary.kernels.triton.varlen import device_offsets, host_bounds, varlen_chunks

TUNING_PACKAGE = "armillary.kernels"
CONV_DEFAULTS = {"BLOCK_T": 32, "BLOCK_C": 128, "num_warps": 4}  # measured best of 5 on an H200 (bench/gdn_kernels.py)


@triton.jit
def _causal_conv1d_varlen_kernel(
    x, weight, bias, conv_states, state_slots, cu_seqlens, chunk_table, out,
    stride_x, stride_w, stride_state, stride_out, channels,
    KW: tl.constexpr, KW_P2: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
):
    i_chunk = tl.program_id(0)
    seq = tl.load(chunk_table + 2 * i_chunk)
    block = tl.load(chunk_table + 2 * i_chunk + 1)
    bos = tl.load(cu_seqlens + seq).to(tl.int64)
    seq_len = (tl.load(cu_seqlens + seq + 1) - bos).to(tl.int32)
    slot = tl.load(state_slots + seq).to(tl.int64)

    pos = block * BLOCK_T + tl.arange(0, BLOCK_T)  # positions inside the sequence
    m_t = pos < seq_len
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m_c = ch < channels
    window = conv_states + slot * stride_state + ch * (KW - 1)  # [BLOCK_C] old-window column 0

    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias + ch, mask=m_c, other=0.0).to(tl.float32)[None, :]
    for j in tl.static_range(KW):
        src = pos - (KW - 1) + j  # input position feeding tap j
        xv = tl.load(x + (bos + src)[:, None] * stride_x + ch[None, :],
                     mask=(m_t & (src >= 0))[:, None] & m_c[None, :], other=0.0)
        w_j = tl.load(weight + ch * stride_w + j, mask=m_c, other=0.0).to(tl.float32)
        acc += xv.to(tl.float32) * w_j[None, :]
    # positions < KW-1 reach into the old window: position r takes column m through tap m - r
    zeros_c = tl.zeros([BLOCK_C], dtype=tl.int32)  # masks mix vectors only (the interpreter mis-types vector & scalar)
    first = m_c & (zeros_c + block == 0)
    for m in tl.static_range(KW - 1):
        old_m = tl.load(window + m, mask=first, other=0.0).to(tl.float32)
        for r in tl.static_range(m + 1):
            w_j = tl.load(weight + ch * stride_w + (m - r), mask=m_c, other=0.0).to(tl.float32)
            acc += tl.where((pos == r)[:, None], (old_m * w_j)[None, :], 0.0)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(out + (bos + pos)[:, None] * stride_out + ch[None, :], acc.to(out.dtype.element_ty),
             mask=m_t[:, None] & m_c[None, :])

    if block == 0:
        # the new window: the sequence's last KW-1 inputs, reaching into the old window when it is short
        col = tl.arange(0, KW_P2)
        new = tl.zeros([KW_P2, BLOCK_C], dtype=conv_states.dtype.element_ty)
        for m in tl.static_range(KW - 1):
            last = zeros_c + seq_len - (KW - 1) + m  # input position of new column m
            from_x = tl.load(x + (bos + last) * stride_x + ch, mask=m_c & (last >= 0), other=0.0)
            from_old = tl.load(window + KW - 1 + last, mask=m_c & (last < 0), other=0.0)
            new = tl.where((col == m)[:, None], (from_x.to(from_old.dtype) + from_old)[None, :], new)
        tl.debug_barrier()  # every read of the old window in this program happens before the overwrite
        tl.store(window[None, :] + col[:, None], new, mask=(col < KW - 1)[:, None] & m_c[None, :])


def causal_conv1d_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor | Sequence[int],
    activation: str | None = "silu",
    cu_seqlens_cpu: Sequence[int] | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """out[t, c] = act(bias[c] + sum_j weight[c, j] · input[t - (K-1) + j, c]) per sequence.

    x: [T, C] (rows may be strided, e.g. the q‖k‖v columns of an in_proj output; channels
    contiguous); weight: [C, K]; bias: [C] or None; conv_states: [num_slots, C, K-1] (any float
    dtype), read as each sequence's preceding inputs and updated in place with its last K-1 inputs;
    state_indices: [B] slot per sequence (distinct); cu_seqlens: [B+1] offsets (device int32
    tensor, or host ints). The chunk table needs the offsets on the host: pass ``cu_seqlens_cpu``
    to avoid reading them back. ``activation``: "silu" or None. Returns [T, C] in x's dtype.
    """
    if activation not in ("silu", None):
        raise ValueError(f"causal_conv1d_prefill: activation {activation!r} is not supported (silu or None)")
    channels, kw = weight.shape
    if x.stride(1) != 1 or weight.stride(1) != 1 or conv_states.shape[1:] != (channels, kw - 1):
        raise ValueError(
            f"causal_conv1d_prefill: x {tuple(x.shape)} weight {tuple(weight.shape)} "
            f"conv_states {tuple(conv_states.shape)} do not agree (channels must be contiguous)"
        )
    if conv_states.stride(2) != 1 or conv_states.stride(1) != kw - 1:
        raise ValueError("causal_conv1d_prefill: conv_states must be contiguous per slot")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    bounds = host_bounds(cu_seqlens, cu_seqlens_cpu)
    if x.shape[0] == 0:
        return out
    cfg = {**kernel_config(TUNING_PACKAGE, "causal_conv1d", f"w{kw}", CONV_DEFAULTS, x.device),
           **(config or {})}
    if cfg["BLOCK_T"] < kw - 1:
        raise ValueError("causal_conv1d_prefill: BLOCK_T must cover the old window (>= kernel - 1)")
    chunks = varlen_chunks(bounds, cfg["BLOCK_T"], x.device)
    grid = (chunks.num_chunks, cdiv(channels, cfg["BLOCK_C"]))
    _causal_conv1d_varlen_kernel[grid](
        x, weight, bias if bias is not None else weight, conv_states, state_indices,
        device_offsets(cu_seqlens, x.device), chunks.table, out,
        x.stride(0), weight.stride(0), conv_states.stride(0), out.stride(0), channels,
        KW=kw, KW_P2=next_power_of_2(kw), BLOCK_T=cfg["BLOCK_T"], BLOCK_C=cfg["BLOCK_C"],
        HAS_BIAS=bias is not None, SILU=activation == "silu", num_warps=cfg["num_warps"],
    )
    return out
