"""Reference multi-head latent attention (MLA), float32: the paged latent cache, the absorbed decode and
the decompressed attention it must equal.

The cache holds one row per token: ``[latent (kv_lora_rank) | rotated rope key (rope_dim)]``. Head
``h`` attends with key ``[W_UK[h] · latent | k_pe]`` and value ``W_UV[h] · latent``, where
``kv_b_proj.weight`` is ``[H · (nope + v), kv_lora_rank]`` (per head ``nope`` key rows, then ``v``
value rows). The absorbed form moves ``W_UK`` onto the query and ``W_UV`` after the attention, so
the scores and the weighted sum run over latents alone.
"""
from __future__ import annotations

import torch

from armillary.kernels.norm import rms_norm
from armillary.kernels.rotary import apply_rotary


def write_latent(kv: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kv: [num_blocks, block_size, Dl + Dr]; latent [T, Dl], k_pe [T, Dr] -> rows ``slot_mapping`` [T]."""
    nb, bs, width = kv.shape
    rows = torch.cat((latent, k_pe), dim=-1).to(kv.dtype)  # [T, Dl + Dr]
    kv.view(nb * bs, width).index_copy_(0, slot_mapping.long(), rows)


def rope_store_ref(q: torch.Tensor, ckv: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                   sin: torch.Tensor, kv: torch.Tensor, slot_mapping: torch.Tensor, interleaved: bool) -> None:
    """``kv_a_layernorm`` on the latent, rotary on the rope key and (in place) on q's last rope dims, the cache
    store. q [T, H, nope + Dr], ckv [T, Dl + Dr], cos / sin [T, Dr / 2]; as ``rope_store.mla_rope_store``."""
    dr = 2 * cos.shape[-1]
    dl = ckv.shape[1] - dr
    latent = rms_norm(ckv[:, :dl], weight, eps)  # [T, Dl]
    k_pe = apply_rotary(ckv[:, None, dl:], cos, sin, interleaved)[:, 0]  # [T, Dr]
    q[..., q.shape[2] - dr:] = apply_rotary(q[..., q.shape[2] - dr:], cos, sin, interleaved)
    write_latent(kv, latent, k_pe, slot_mapping)


def gather_latent(kv: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` cached rows of one sequence: [length, Dl + Dr]."""
    bs = kv.shape[1]
    nblocks = -(-length // bs)
    return kv.index_select(0, block_table[:nblocks].long()).view(nblocks * bs, kv.shape[2])[:length]


def mla_decode_ref(q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, block_tables: torch.Tensor,
                   seq_lens: torch.Tensor, scale: float, max_seq_len: int) -> torch.Tensor:
    """Absorbed decode, batched: one query per sequence over its ``seq_lens[b]`` cached latents.

    q_lat [B, H, Dl] (query already through ``W_UK``), q_pe [B, H, Dr], kv [NB, BS, Dl + Dr],
    block_tables [B, max_blocks], seq_lens [B]; ``max_seq_len`` bounds the gather (a host int).
    Returns the attention-weighted latents [B, H, Dl] in q_lat's dtype (``W_UV`` not applied).
    """
    batch, _, dl = q_lat.shape
    bs = kv.shape[1]
    nblocks = max(1, -(-max_seq_len // bs))
    blocks = block_tables[:, :nblocks].long()  # [B, n]
    rows = kv.index_select(0, blocks.reshape(-1)).view(batch, nblocks * bs, kv.shape[2]).float()  # [B, L, Dl + Dr]
    q = torch.cat((q_lat, q_pe), dim=-1).float()  # [B, H, Dl + Dr]
    scores = torch.einsum("bhd,bld->bhl", q, rows) * scale
    visible = torch.arange(rows.shape[1], device=kv.device)[None, :] < seq_lens.long()[:, None]  # [B, L]
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    probs = torch.nan_to_num(scores.softmax(-1))  # a sequence with nothing cached (padding) gives zeros
    return torch.einsum("bhl,bld->bhd", probs, rows[..., :dl]).to(q_lat.dtype)


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q_nope [T, H, nope] · W_UK [H, nope, Dl] -> [T, H, Dl] (per head, batched over tokens)."""
    return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)


def expand_values(out_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """out_lat [T, H, Dl] · W_UV[h]ᵀ (W_UV [H, v, Dl]) -> [T, H, v]."""
    return torch.bmm(out_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


def mla_decompressed_ref(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                         kv_b_weight: torch.Tensor, scale: float) -> torch.Tensor:
    """One sequence as transformers computes it: keys and values expanded from the latents, causal MHA.

    q_nope [n, H, nope], q_pe [n, H, Dr] for the last ``n`` of ``L`` positions; latent [L, Dl],
    k_pe [L, Dr]; kv_b_weight [H · (nope + v), Dl]. Returns [n, H, v] float32.
    """
    n, heads, nope = q_nope.shape
    length = latent.shape[0]
    kv = (latent.float() @ kv_b_weight.float().T).view(length, heads, -1)  # [L, H, nope + v]
    k = torch.cat((kv[..., :nope], k_pe.float()[:, None, :].expand(length, heads, -1)), dim=-1)
    v = kv[..., nope:]
    q = torch.cat((q_nope, q_pe), dim=-1).float()
    scores = torch.einsum("nhd,lhd->hnl", q, k) * scale  # [H, n, L]
    qpos = torch.arange(length - n, length, device=q.device)[:, None]
    scores = scores.masked_fill(torch.arange(length, device=q.device)[None, :] > qpos, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)
