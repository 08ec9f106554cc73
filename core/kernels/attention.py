"""Attention over the paged KV cache, plain torch: the reference and CPU implementation.

A prefill chunk's softmax(q·kᵀ)·v runs per sequence through torch's fused
``scaled_dot_product_attention`` in float32 (on the CPU its flash kernel skips the masked half of a
causal prompt and never holds the ``[H, n, L]`` score matrix); a decode step (one token per sequence)
runs all sequences in two batched matmuls; a soft-capped layer uses the explicit float32 math of
``attend_explicit``, which is also the oracle the other paths are tested against.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from armillary.forward_batch import KVCache


def write_kv(cache: KVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store new keys/values. k, v: [T, Hkv, D]; slot_mapping: [T] flat slots."""
    nb, bs = cache.k.shape[:2]
    slots = slot_mapping.long()
    for dst, src, scale in ((cache.k, k, cache.k_scale), (cache.v, v, cache.v_scale)):
        if scale is not None:  # fp8 pages hold x / scale, saturated; the CPU has no fp8 index_copy_: bytes
            src = (src.float() / scale).clamp(-448.0, 448.0).to(dst.dtype).view(torch.uint8)
            dst = dst.view(torch.uint8)
        if dst.stride(0) == bs * dst.stride(1):
            # index_copy_ / index_select, not advanced indexing: on a 2-thread CPU that costs 2-10x more
            dst.view(nb * bs, *dst.shape[2:]).index_copy_(0, slots, src.to(dst.dtype))
        else:  # a block-strided view (pages of several shapes share storage): address (block, offset)
            dst[slots // bs, slots % bs] = src.to(dst.dtype)


def gather_kv(cache: KVCache, block_table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``length`` cached tokens of one sequence: ([length, Hkv, D], [length, Hkv, Dv])."""
    bs = cache.block_size
    nblocks = (length + bs - 1) // bs
    blocks = block_table[:nblocks].long()
    k = cache.k.index_select(0, blocks).view(nblocks * bs, *cache.k.shape[2:])[:length]
    v = cache.v.index_select(0, blocks).view(nblocks * bs, *cache.v.shape[2:])[:length]
    return read_pages(k, cache.k_scale), read_pages(v, cache.v_scale)


def read_pages(pages: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Cached values as stored, or dequantized to float32 (``q · scale``) from an fp8 cache."""
    return pages if scale is None else pages.float() * scale


def visible(n: int, length: int, sliding_window: int | None, device: torch.device) -> torch.Tensor:
    """[n, length] bool: query ``i`` (position ``length - n + i``) sees key ``j`` iff ``j <= pos`` and,
    when windowed, ``pos - j < sliding_window`` (transformers' Mistral mask: ``kv_idx > q_idx - window``)."""
    qpos = torch.arange(length - n, length, device=device)[:, None]
    kpos = torch.arange(length, device=device)[None, :]
    mask = kpos <= qpos
    if sliding_window:
        mask &= kpos > qpos - sliding_window
    return mask


def attend_explicit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """One sequence, float32 scores materialised: q [n, Hq, D], k [L, Hkv, D], v [L, Hkv, Dv] -> [n, Hq, Dv]
    in q's dtype. The queries are the last ``n`` of the ``L`` positions."""
    n, hq, _ = q.shape
    length, hkv = k.shape[:2]
    qf = q.float().transpose(0, 1)  # [Hq, n, D]
    kf = k.float().repeat_interleave(hq // hkv, dim=1).transpose(0, 1)  # [Hq, L, D]
    vf = v.float().repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
    scores = qf @ kf.transpose(1, 2) * scale  # [Hq, n, L]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible(n, length, sliding_window, q.device), float("-inf"))
    return (scores.softmax(-1) @ vf).transpose(0, 1).to(q.dtype)


def attend_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 sliding_window: int | None = None) -> torch.Tensor:
    """``attend_explicit`` without a soft-cap, through torch's fused SDPA in float32 (same shapes)."""
    n, hq, _ = q.shape
    length, hkv = k.shape[:2]
    qf = q.float().transpose(0, 1).contiguous()[None]  # [1, Hq, n, D]: the CPU flash kernel wants dense heads
    kf = k.float().transpose(0, 1).contiguous()[None]  # [1, Hkv, L, D]
    vf = v.float().transpose(0, 1).contiguous()[None]
    windowed = bool(sliding_window) and sliding_window < length
    mask, causal = None, False
    if windowed or (1 < n < length):
        mask = visible(n, length, sliding_window, q.device)  # [n, L]: chunk after cached context, or a window
    elif n == length:
        causal = True  # a fresh prompt: top-left causal is the same as ours
    out = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, is_causal=causal, scale=scale,
                                         enable_gqa=hq != hkv)  # [1, Hq, n, Dv]
    return out[0].transpose(0, 1).to(q.dtype)


def paged_attention(
    q: torch.Tensor,
    cache: KVCache,
    block_tables: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal GQA attention of new queries over each sequence's whole cached context.

    q: [T, Hq, D] (new tokens, already written to the cache with ``write_kv``)
    block_tables: [B, max_blocks]; query_start_loc: B+1 host ints; seq_lens: B host ints
    (cached + new). Query ``i`` of sequence ``b`` sits at position ``seq_lens[b] - n_b + i``
    and sees keys at positions ``<=`` its own (and ``> pos - sliding_window`` when windowed).
    Returns [T, Hq, Dv] in q's dtype; float32 math.
    """
    T, Hq, _ = q.shape
    if not softcap and T == len(seq_lens) and query_start_loc == list(range(T + 1)):  # one new token each: decode
        return _decode_batched(q, cache, block_tables, seq_lens, scale, sliding_window)
    out = q.new_empty(T, Hq, cache.v.shape[3])
    for b in range(len(seq_lens)):
        s, e = query_start_loc[b], query_start_loc[b + 1]
        if e == s:
            continue
        L = seq_lens[b]
        lo = max(0, L - (e - s) - sliding_window + 1) if sliding_window else 0  # keys no query of the chunk sees
        k, v = gather_kv(cache, block_tables[b], L)
        k, v = k[lo:], v[lo:]
        if softcap:
            out[s:e] = attend_explicit(q[s:e], k, v, scale, sliding_window, softcap)
        else:
            out[s:e] = attend_fused(q[s:e], k, v, scale, sliding_window)
    return out


def _decode_batched(q: torch.Tensor, cache: KVCache, block_tables: torch.Tensor, seq_lens: list[int],
                    scale: float, sliding_window: int | None) -> torch.Tensor:
    """One query per sequence, all sequences at once over their padded block tables (no Python loop).

    Two batched matmuls over [B, Hkv] with the GQA group as rows: on a small CPU this beats a fused
    SDPA call, whose threading costs more than the arithmetic of one query.
    """
    B, Hq, _ = q.shape
    Hkv, bs = cache.k.shape[2], cache.block_size
    nblocks = -(-max(seq_lens) // bs)
    blocks = block_tables[:, :nblocks].reshape(-1).long()
    k = read_pages(cache.k.index_select(0, blocks), cache.k_scale).view(B, nblocks * bs, Hkv, -1).float().transpose(1, 2)  # [B, Hkv, L, D]
    v = read_pages(cache.v.index_select(0, blocks), cache.v_scale).view(B, nblocks * bs, Hkv, -1).float().transpose(1, 2)  # [B, Hkv, L, Dv]
    qg = q.float().view(B, Hkv, Hq // Hkv, -1)  # [B, Hkv, G, D]
    scores = torch.matmul(qg, k.transpose(2, 3)).mul_(scale)  # [B, Hkv, G, L]
    lens = torch.tensor(seq_lens, device=q.device)[:, None]  # [B, 1]
    kpos = torch.arange(k.shape[2], device=q.device)[None, :]
    mask = kpos < lens
    if sliding_window:
        mask &= kpos >= lens - sliding_window
    scores.masked_fill_(~mask[:, None, None, :], float("-inf"))
    # slots past a sequence's length hold whatever the pool's memory held (NaN bytes on a GPU): 0 · NaN is NaN
    v.masked_fill_(~mask[:, None, :, None], 0.0)  # in place: index_select made v a copy of the pages
    out = torch.matmul(scores.softmax(-1), v)  # [B, Hkv, G, Dv]
    return out.reshape(B, Hq, -1).to(q.dtype)
