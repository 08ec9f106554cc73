"""Multi-head latent attention (MLA) of glm4_moe_lite over the paged latent cache.

``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj`` (one launch on decode steps, ``ops/norm_gemv.py``; or one
``q_proj`` without ``q_lora_rank``) gives
per head ``nope`` + ``rope`` query dims; ``kv_a_proj_with_mqa`` gives the ``kv_lora_rank`` latent
(normed by ``kv_a_layernorm``) and one rope key shared by all heads; the cache keeps
``[latent | rotated rope key]`` per token. Decode runs the absorbed form over latents: on Triton three
launches per layer between the projections (``ops/mla/absorb.py``: rope / norm / store and q through
W_UK; ``ops/mla/decode.py``: attention over the latents; ``ops/mla/expand.py``: the splits combined
and taken through W_UV into ``o_proj``'s layout); prefill chunks expand keys and values through
``kv_b_proj`` and run MHA.

Tensor parallelism splits by heads, as vLLM and SGLang shard MLA: ``q_b_proj`` (or ``q_proj``) and ``kv_b_proj``
keep this rank's heads' rows (both are head-major, so a row split is a head split), ``o_proj`` its heads' columns
and sums once over the ranks; ``q_a_proj``, ``kv_a_proj_with_mqa`` and their norms are replicated, so every rank
writes the same whole latent into its own cache and attends over it with its heads only.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from armillary.forward_batch import ForwardBatch, LatentCache
from armillary.kernels import ops
from armillary.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RMSNorm,
    RowParallelLinear,
)
from armillary.layers.quantization.unquantized import UnquantizedLinearMethod
from armillary.parallel import get_parallel, use_parallel
from armillary_glm_flash.config import GlmFlashConfig
from armillary_glm_flash.ops import norm_gemv
from armillary_glm_flash.ops.mla.absorb import mla_absorb, mla_absorb_rope_store
from armillary_glm_flash.ops.mla.expand import mla_decode_values
from armillary_glm_flash.ops.mla.naive import absorb_query, expand_values, gather_latent, mla_decode_ref, rope_store_ref
from armillary_glm_flash.ops.mla.prefill import decompressed_attention, expanded_keys
from armillary_glm_flash.ops.mla.rope_store import mla_rope_store

ABSORB_MAX_QUERY = 8  # a chunk of at most this many tokens after cached context attends over latents


class LatentAttention(nn.Module):
    """Head counts are this tensor-parallel rank's (``q_b_proj`` / ``kv_b_proj`` column-, ``o_proj`` row-parallel)."""

    def __init__(self, cfg: GlmFlashConfig, prefix: str = "") -> None:
        super().__init__()
        hidden, bias = cfg.hidden_size, cfg.attention_bias
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank, self.q_lora_rank = cfg.kv_lora_rank, cfg.q_lora_rank
        heads = cfg.num_attention_heads
        qk = self.nope + self.rope
        kv_a = self.kv_lora_rank + self.rope
        par = get_parallel()
        if heads % par.tp_size:  # a column split of q_b / kv_b rows would otherwise cut a head in two
            raise ValueError(f"{heads} MLA attention heads do not split over tensor-parallel size {par.tp_size}: "
                             "q_b_proj, kv_b_proj and o_proj are sharded by whole heads")
        # one GEMM for both down-projections of x: [q_a_proj | kv_a_proj_with_mqa] rows (checkpoint_pieces). They
        # are replicated under tensor parallelism (every rank needs the whole q latent and the whole kv latent: the
        # latent cache is not split by heads), so the merged layer is built as on one rank
        self.fused_a = self.q_lora_rank is not None
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, heads * qk, False, prefix=f"{prefix}.q_proj")
        else:
            with use_parallel(replace(par, tp_rank=0, tp_size=1)):
                self.qkv_a_proj = MergedColumnParallelLinear(hidden, [self.q_lora_rank, kv_a], bias,
                                                             prefix=f"{prefix}.qkv_a_proj")
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, 1e-6)  # transformers' Glm4MoeLiteRMSNorm default eps
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, heads * qk, False, prefix=f"{prefix}.q_b_proj")
        if not self.fused_a:
            self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, kv_a, bias, prefix=f"{prefix}.kv_a_proj_with_mqa")
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, 1e-6)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, heads * (self.nope + self.v_dim), False,
                                              prefix=f"{prefix}.kv_b_proj")
        self.o_proj = RowParallelLinear(heads * self.v_dim, hidden, bias, prefix=f"{prefix}.o_proj")
        self.num_heads = self.kv_b_proj.output_size_per_partition // (self.nope + self.v_dim)
        self.scale = cfg.softmax_scale
        self.interleaved = cfg.rope_interleave

    def checkpoint_pieces(self, local_name: str, tensor: torch.Tensor) -> list | None:
        """``q_a_proj.*`` / ``kv_a_proj_with_mqa.*`` -> slot 0 / 1 of ``qkv_a_proj`` (when fused)."""
        proj, _, attr = local_name.partition(".")
        if not self.fused_a or proj not in ("q_a_proj", "kv_a_proj_with_mqa") or not attr:
            return None
        return [(f"qkv_a_proj.{attr}", tensor, {"shard_id": 0 if proj == "q_a_proj" else 1})]

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, Dl], W_UV [H, v, Dl]): views of ``kv_b_proj.weight``, per head [nope rows | v rows];
        H is this rank's heads (the column-parallel rows it keeps), so the absorbed decode needs no other slicing."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
        return w[:, : self.nope], w[:, self.nope:]

    def _triton(self, x: torch.Tensor) -> bool:
        """Whether the absorbed steps run the Triton kernels (they read ``kv_b_proj.weight`` in x's dtype)."""
        return ops.use_triton(x) and self.kv_b_proj.weight.dtype == x.dtype

    def _q_b(self, q_a: torch.Tensor) -> torch.Tensor:
        """``q_b_proj(q_a_layernorm(q_a))``: [T, q_lora_rank] -> [T, H · (nope + Dr)]; decode-sized rows of an
        unquantized ``q_b_proj`` in one launch with the norm fused (``ops/norm_gemv.py``)."""
        norm, proj = self.q_a_layernorm, self.q_b_proj
        if isinstance(proj.quant_method, UnquantizedLinearMethod) and norm_gemv.serves(q_a, norm.weight, proj.weight):
            return norm_gemv.norm_gemv(q_a, norm.weight, norm.eps, proj.weight)
        return proj(norm(q_a))

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: LatentCache, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        """x: [T, H]; cos, sin: [T, rope // 2] -> [T, H]. Writes the new latents to ``cache``."""
        num_tokens = x.shape[0]
        if self.fused_a:
            q_a, ckv = self.qkv_a_proj(x).split([self.q_lora_rank, self.kv_lora_rank + self.rope], dim=-1)
            q = self._q_b(q_a)
        else:
            q = self.q_proj(x) if self.q_lora_rank is None else self._q_b(self.q_a_proj(x))
            ckv = self.kv_a_proj_with_mqa(x)  # [T, Dl + Dr]
        q = q.view(num_tokens, self.num_heads, self.nope + self.rope)
        # kv_a_layernorm, rotary on the rope key and (in place) on q's rope dims, the latent store
        store_args = (ckv, self.kv_a_layernorm.weight, self.kv_a_layernorm.eps, cos, sin, cache.kv,
                      batch.slot_mapping_of(cache), self.interleaved)
        all_absorbed = batch.is_decode_only or batch.query_start_loc_cpu is None
        q_lat = None
        if all_absorbed and self._triton(x):  # ... and q_nope through W_UK, in the same launch
            q_lat = mla_absorb_rope_store(q, self.absorbed_weights()[0], *store_args)  # [T, H, Dl]
        elif ops.use_triton(x):
            mla_rope_store(q, *store_args)
        else:
            rope_store_ref(q, *store_args)
        if batch.is_decode_only:
            out = self._absorbed(q, q_lat, cache.kv, batch.block_tables_of(cache), batch.seq_lens,
                                 batch.max_seq_len)
        elif batch.query_start_loc_cpu is None:
            out = self._verify(q, q_lat, cache, batch)
        else:
            out = self._prefill(q, cache, batch)
        return self.o_proj(out)

    def _absorbed(self, q: torch.Tensor, q_lat: torch.Tensor | None, kv: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, max_seq_len: int) -> torch.Tensor:
        """Rows of one query each: q [R, H, nope + Dr] (rope dims rotated), q_lat [R, H, Dl] if already
        absorbed -> [R, H · v] (``o_proj``'s input)."""
        w_uk, w_uv = self.absorbed_weights()
        q_pe = q[..., self.nope:]
        if self._triton(q):
            if q_lat is None:
                q_lat = mla_absorb(q[..., : self.nope], w_uk)
            return mla_decode_values(q_lat, q_pe, kv, block_tables, seq_lens, self.scale, max_seq_len, w_uv)
        q_lat = absorb_query(q[..., : self.nope], w_uk)  # [R, H, Dl]
        out_lat = mla_decode_ref(q_lat, q_pe, kv, block_tables, seq_lens, self.scale, max_seq_len)
        return expand_values(out_lat, w_uv).reshape(q.shape[0], self.num_heads * self.v_dim)

    def _verify(self, q: torch.Tensor, q_lat: torch.Tensor | None, cache: LatentCache,
                batch: ForwardBatch) -> torch.Tensor:
        """A step without host lists (a captured speculative verify): every sequence has the same number of new
        tokens after its context, so token ``t`` belongs to sequence ``t // (T / B)``; all absorbed, no host sync."""
        num_tokens, num_seqs = q.shape[0], batch.num_seqs
        if num_seqs == 0 or num_tokens % num_seqs:
            raise RuntimeError("an MLA step without host lists needs the same number of new tokens per sequence")
        seqs = torch.arange(num_tokens, device=q.device) // (num_tokens // num_seqs)
        lens = (batch.positions + 1).to(torch.int32)  # each row sees up to itself
        tables = batch.block_tables_of(cache).index_select(0, seqs)
        return self._absorbed(q, q_lat, cache.kv, tables, lens, batch.max_seq_len)

    def _prefill(self, q: torch.Tensor, cache: LatentCache, batch: ForwardBatch) -> torch.Tensor:
        """A mixed step: fresh prompts and long chunks decompressed, short chunks after context absorbed.
        q: [T, H, nope + Dr] (rope dims rotated); the step's latents are already in ``cache``."""
        qsl, ctx = batch.query_start_loc_cpu, batch.context_lens_cpu
        if qsl is None or ctx is None:
            raise RuntimeError("MLA prefill needs the batch's host lists (it never runs inside a CUDA graph)")
        num_tokens = q.shape[0]
        out = q.new_empty(num_tokens, self.num_heads, self.v_dim)
        tables = batch.block_tables_of(cache)
        fresh_kv = fresh_pe = None  # the new tokens' expanded latents, computed once if a fresh prompt needs them
        rows: list[int] = []
        row_seqs: list[int] = []
        for b in range(len(qsl) - 1):
            start, end, context = qsl[b], qsl[b + 1], ctx[b]
            n = end - start
            if n == 0:
                continue
            if context > 0 and n <= ABSORB_MAX_QUERY:
                rows.extend(range(start, end))
                row_seqs.extend([b] * n)
                continue
            if context == 0:
                if fresh_kv is None:
                    slots = batch.slot_mapping_of(cache).long()
                    new = cache.kv.view(-1, cache.kv.shape[2]).index_select(0, slots)  # [T, Dl + Dr]
                    fresh_kv = self.kv_b_proj(new[:, : self.kv_lora_rank]).view(num_tokens, self.num_heads, -1)
                    fresh_pe = new[:, self.kv_lora_rank:]
                kv, pe = fresh_kv[start:end], fresh_pe[start:end]
            else:
                cached = gather_latent(cache.kv, tables[b], context + n)  # [L, Dl + Dr]
                kv = self.kv_b_proj(cached[:, : self.kv_lora_rank]).view(context + n, self.num_heads, -1)
                pe = cached[:, self.kv_lora_rank:]
            k, v = expanded_keys(kv, pe, self.nope, ops.use_triton(q))
            attn = decompressed_attention(q[start:end], k, v, context, self.scale)  # [n, H, v]
            if n == num_tokens:  # one chunk is the whole step: SDPA's output as it is, not copied (95 us at 16K)
                return attn.reshape(num_tokens, self.num_heads * self.v_dim)
            out[start:end] = attn
        if rows:
            index = torch.tensor(rows, dtype=torch.long, device=q.device)
            seqs = torch.tensor(row_seqs, dtype=torch.long, device=q.device)
            lens = (batch.positions.index_select(0, index) + 1).to(torch.int32)  # each row sees up to itself
            out[index] = self._absorbed(q.index_select(0, index), None, cache.kv, tables.index_select(0, seqs),
                                        lens, batch.max_seq_len).view(len(rows), self.num_heads, self.v_dim)
        return out.view(num_tokens, self.num_heads * self.v_dim)
