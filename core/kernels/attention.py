"""Attention over the paged KV cache, plain torch: the reference and CPU implementation."""
from __future__ import annotations

import torch

from armillary.forward_batch import KVCache


def write_kv(cache: KVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store new keys/values. k, v: [T, Hkv, D]; slot_mapping: [T] flat slots."""
    nb, bs = cache.k.shape[:2]
    cache.k.view(nb * bs, *cache.k.shape[2:])[slot_mapping] = k.to(cache.k.dtype)
    cache.v.view(nb * bs, *cache.v.shape[2:])[slot_mapping] = v.to(cache.v.dtype)


def gather_kv(cache: KVCache, block_table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``length`` cached tokens of one sequence: ([length, Hkv, D], [length, Hkv, Dv])."""
    bs = cache.block_size
    nblocks = (length + bs - 1) // bs
    blocks = block_table[:nblocks].long()
    k = cache.k[blocks].reshape(nblocks * bs, *cache.k.shape[2:])[:length]
    v = cache.v[blocks].reshape(nblocks * bs, *cache.v.shape[2:])[:length]
    return k, v


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
    Returns [T, Hq, Dv] in q's dtype; softmax in float32.
    """
    T, Hq, _ = q.shape
    Hkv = cache.k.shape[2]
    if T == len(seq_lens) and T > 1 and not softcap:
        return _decode_batched(q, cache, block_tables, seq_lens, scale, sliding_window)
    out = q.new_empty(T, Hq, cache.v.shape[3])
    for b in range(len(seq_lens)):
        s, e = query_start_loc[b], query_start_loc[b + 1]
        if e == s:
            continue
        n, L = e - s, seq_lens[b]
        k, v = gather_kv(cache, block_tables[b], L)
        qb = q[s:e].float().transpose(0, 1)  # [Hq, n, D]
        k = k.float().repeat_interleave(Hq // Hkv, dim=1).transpose(0, 1)  # [Hq, L, D]
        v = v.float().repeat_interleave(Hq // Hkv, dim=1).transpose(0, 1)
        scores = qb @ k.transpose(1, 2) * scale  # [Hq, n, L]
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        qpos = torch.arange(L - n, L, device=q.device)[:, None]
        kpos = torch.arange(L, device=q.device)[None, :]
        mask = kpos <= qpos
        if sliding_window:
            mask &= kpos > qpos - sliding_window
        scores = scores.masked_fill(~mask, float("-inf"))
        out[s:e] = (scores.softmax(-1) @ v).transpose(0, 1).to(q.dtype)
    return out


def _decode_batched(q: torch.Tensor, cache: KVCache, block_tables: torch.Tensor, seq_lens: list[int],
                    scale: float, sliding_window: int | None) -> torch.Tensor:
    """One query per sequence, all sequences at once over their padded block tables (no Python loop)."""
    B, Hq, _ = q.shape
    Hkv, bs = cache.k.shape[2], cache.block_size
    nblocks = -(-max(seq_lens) // bs)
    blocks = block_tables[:, :nblocks].long()
    k = cache.k[blocks].flatten(1, 2).float()  # [B, L, Hkv, D]
    v = cache.v[blocks].flatten(1, 2).float()
    qg = q.float().view(B, Hkv, Hq // Hkv, -1)  # [B, Hkv, G, D]
    scores = torch.einsum("bhgd,blhd->bhgl", qg, k) * scale
    lens = torch.tensor(seq_lens, device=q.device)[:, None]  # [B, 1]
    kpos = torch.arange(k.shape[1], device=q.device)[None, :]
    mask = kpos < lens
    if sliding_window:
        mask &= kpos >= lens - sliding_window
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    out = torch.einsum("bhgl,blhd->bhgd", scores.softmax(-1), v)
    return out.reshape(B, Hq, -1).to(q.dtype)
