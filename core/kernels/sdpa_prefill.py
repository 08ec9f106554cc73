"""Prefill attention of fresh prompts (no cached context) through torch's fused SDPA (cuDNN / flash).

A long prompt spends its attention time in the causal self-attention of its new tokens; on sm_90
cuDNN runs that at about twice the rate of the Triton varlen kernel (bench/RESULTS.md: 16K tokens,
3.15 vs 6.36 ms). ``ops.attention`` takes this path only when every sequence of the step starts at
position 0 with long enough prompts, in half precision, with no sliding window or soft-cap.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from armillary.forward_batch import KVCache
from armillary.kernels.attention import gather_kv
from armillary.kernels.triton.gate import sigmoid_gate_

FAST_BACKENDS = (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION)
MIN_MEAN_PROMPT = 1024  # shorter prompts: one varlen Triton launch beats a loop of SDPA calls

_refused: set[tuple] = set()  # shapes a backend list refused once; not tried again


def worth_it(context_lens: list[int], query_start_loc: list[int]) -> bool:
    """Fresh prompts only (nothing cached before this step), long enough on average."""
    num_seqs = len(context_lens)
    return num_seqs > 0 and not any(context_lens) and query_start_loc[-1] >= MIN_MEAN_PROMPT * num_seqs


def fresh_prefill_attention(
    q: torch.Tensor,
    cache: KVCache,
    block_tables: torch.Tensor,
    query_start_loc: list[int],
    scale: float,
    backends: tuple[SDPBackend, ...] = FAST_BACKENDS,
) -> torch.Tensor | None:
    """Causal self-attention of sequences with no cached context, their K/V already in ``cache``.

    q: [T, Hq, D]; block_tables: [B, max_blocks]; query_start_loc: B+1 host ints.
    Returns [T, Hq, Dv] (unit last stride; SDPA's own output when one prompt fills the step), or None when none
    of ``backends`` takes these shapes (use the paged kernels).
    """
    hkv = cache.k.shape[2]
    key = (q.dtype, q.device.type, q.shape[1], hkv, q.shape[2], cache.v.shape[3], backends)
    if key in _refused:
        return None
    out = q.new_empty(q.shape[0], q.shape[1], cache.v.shape[3])
    try:
        with sdpa_kernel(list(backends)):
            for b in range(len(query_start_loc) - 1):
                start, end = query_start_loc[b], query_start_loc[b + 1]
                if end == start:
                    continue
                k, v = gather_kv(cache, block_tables[b], end - start)  # [L, Hkv, D], [L, Hkv, Dv]
                k, v = k.to(q.dtype), v.to(q.dtype)  # an fp8 cache comes back dequantized in fp32
                o = F.scaled_dot_product_attention(
                    q[start:end].transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                    v.transpose(0, 1).unsqueeze(0), is_causal=True, scale=scale, enable_gqa=q.shape[1] != hkv,
                )  # [1, Hq, L, Dv]
                if end - start == q.shape[0]:  # one prompt is the whole step: SDPA's output, not a copy of it
                    return o[0].transpose(0, 1)
                out[start:end] = o[0].transpose(0, 1)
    except RuntimeError:  # no backend of the list supports this dtype / head dim / GQA layout
        _refused.add(key)
        return None
    return out


def supports(device: torch.device, dtype: torch.dtype | None, *, decode_only: bool = False,
             sliding_window: int | None = None, softcap: float | None = None, context_lens: list[int] | None = None,
             query_start_loc: list[int] | None = None, **_: object) -> bool:
    """The ``fresh_prefill_attention`` check: CUDA; per call half precision, no window or soft-cap,
    fresh long prompts (``worth_it``)."""
    if device.type != "cuda":
        return False
    if dtype is None:
        return True
    return (not decode_only and not sliding_window and not softcap and dtype in (torch.float16, torch.bfloat16)
            and context_lens is not None and worth_it(context_lens, query_start_loc))


def fresh_prefill(q: torch.Tensor, cache: KVCache, batch, scale: float, sliding_window: int | None,
                  softcap: float | None, gate: torch.Tensor | None) -> torch.Tensor | None:
    """``fresh_prefill_attention`` in the interface's signature; None when no SDPA backend takes the shapes.
    The gate is applied in place in one Triton pass (rounded as ``out * torch.sigmoid(gate)``)."""
    out = fresh_prefill_attention(q, cache, batch.block_tables_of(cache), batch.query_start_loc_cpu, scale)
    if out is None or gate is None:
        return out
    return sigmoid_gate_(out, gate)
