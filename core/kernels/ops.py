"""The kernel interfaces models call: Triton on CUDA, the plain-torch references elsewhere.

``set_backend("reference")`` forces the references on CUDA too (the oracle for fast-path tests;
the engine then runs eagerly, since the reference paths read host-side batch lists).
``set_backend("triton")`` forces the Triton kernels on every device: on the CPU under
``TRITON_INTERPRET=1`` that runs a whole model through the fast path in CI.
"""
from __future__ import annotations

import torch

from armillary.forward_batch import ForwardBatch, KVCache
from armillary.kernels import attention as _attn
from armillary.kernels import moe as _moe
from armillary.kernels import norm as _norm
from armillary.kernels import rotary as _rotary
from armillary.kernels import sdpa_prefill as _sdpa

_BACKENDS = ("auto", "reference", "triton")
_backend = "auto"


def set_backend(name: str) -> None:
    global _backend
    if name not in _BACKENDS:
        raise ValueError(f"kernel backend must be one of {_BACKENDS}, not {name!r}")
    _backend = name


def get_backend() -> str:
    return _backend


def use_triton(x: torch.Tensor) -> bool:
    """Whether the Triton kernels serve this tensor's device under the current backend."""
    return _backend == "triton" or (x.is_cuda and _backend == "auto")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``: x [M, K], weight [N, K] (nn.Linear's) -> [M, N].

    Decode-sized x (at most the table's ``max_rows`` rows) takes the Triton skinny GEMM where the
    target's tuning table says it beats cuBLAS (always, under the forced "triton" backend);
    prefill, other layouts and the CPU reference take ``F.linear``.
    """
    if use_triton(x) and x.dim() == 2:
        from armillary.kernels.triton import skinny_gemm as tri

        cfg = tri.serves(x, weight, bias, require_win=_backend != "triton")
        if cfg is not None:
            return tri.skinny_gemm(x, weight, bias, config=cfg)
    return torch.nn.functional.linear(x, weight, bias)


def store_kv(cache: KVCache, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> None:
    """Write new keys / values ``[T, Hkv, D]`` into the paged cache at ``batch.slot_mapping``."""
    if use_triton(k):
        from armillary.kernels.triton.kv_cache import write_kv_cache

        write_kv_cache(k, v, cache.k, cache.v, batch.slot_mapping_of(cache))
    else:
        _attn.write_kv(cache, k, v, batch.slot_mapping_of(cache))


def attention(q: torch.Tensor, cache: KVCache, batch: ForwardBatch, scale: float,
              sliding_window: int | None = None, softcap: float | None = None,
              gate: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of the step's queries ``[T, Hq, D]`` over each sequence's cached context.

    ``gate``: optional [T, Hq, Dv] (unit last stride); the output is then ``attn · sigmoid(gate)``,
    each factor rounded to the model dtype as the unfused torch ops round them.
    """
    if not use_triton(q):
        if batch.seq_lens_cpu is None:
            raise RuntimeError("the reference attention reads host lists, which a CUDA-graph batch does not have")
        out = _attn.paged_attention(q, cache, batch.block_tables_of(cache), batch.query_start_loc_cpu, batch.seq_lens_cpu,
                                    scale, sliding_window, softcap)
        return _gated(out, gate)
    if (q.is_cuda and not batch.is_decode_only and not sliding_window and not softcap
            and q.dtype in (torch.float16, torch.bfloat16)
            and _sdpa.worth_it(batch.context_lens_cpu, batch.query_start_loc_cpu)):
        out = _sdpa.fresh_prefill_attention(q, cache, batch.block_tables_of(cache), batch.query_start_loc_cpu, scale)
        if out is not None:
            return _gated(out, gate)
    from armillary.kernels.triton import paged_attention as tri

    if batch.is_decode_only:
        return tri.paged_attention_decode(q, cache.k, cache.v, batch.block_tables_of(cache), batch.seq_lens, scale,
                                          sliding_window, softcap, max_seq_len=batch.max_seq_len, gate=gate)
    return tri.paged_attention_prefill(q, cache.k, cache.v, batch.block_tables_of(cache), batch.query_start_loc,
                                       batch.seq_lens, batch.max_query_len, scale, sliding_window, softcap,
                                       max_seq_len=batch.max_seq_len, gate=gate)


def _gated(out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """``out · sigmoid(gate)`` with torch ops (out, gate: [T, H, D]); ``out`` itself without a gate."""
    if gate is None:
        return out
    return out * torch.sigmoid(gate)  # elementwise on the [T, H, D] views: no copy of the strided gate


def qk_norm_rope_store(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                       k_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                       batch: ForwardBatch, zero_centered: bool = True) -> torch.Tensor:
    """Per-head RMSNorm of q and k, neox rotary on their first ``2 * cos.shape[-1]`` dims, K/V store.

    query: [T, Hq, D], k: [T, Hkv, D], v: [T, Hkv, Dv] (views of the qkv projection); cos, sin:
    [T, rotary_dim / 2]. Writes k (normed, rotated) and v to ``cache`` at ``batch.slot_mapping``;
    returns q [T, Hq, D]. One launch on Triton; otherwise the unfused reference ops.
    """
    if use_triton(query):
        from armillary.kernels.triton.qk_norm_rope import qk_norm_rope_store as tri

        return tri(query, k, v, q_weight, k_weight, eps, cos, sin, cache.k, cache.v, batch.slot_mapping_of(cache),
                   zero_centered)
    q = _rotary.apply_rotary(_norm.rms_norm(query, q_weight, eps, zero_centered), cos, sin)
    k = _rotary.apply_rotary(_norm.rms_norm(k, k_weight, eps, zero_centered), cos, sin)
    _attn.write_kv(cache, k, v, batch.slot_mapping_of(cache))
    return q


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False) -> torch.Tensor:
    if use_triton(x):
        from armillary.kernels.triton.norm import rms_norm as tri

        return tri(x, weight, eps, zero_centered)
    return _norm.rms_norm(x, weight, eps, zero_centered)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 zero_centered: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``r = x + residual`` (rounded to the model dtype) and ``rms_norm(r)``; returns (normed, r)."""
    if use_triton(x):
        from armillary.kernels.triton.norm import fused_add_rms_norm

        return fused_add_rms_norm(x, residual, weight, eps, zero_centered)
    r = x + residual
    return _norm.rms_norm(r, weight, eps, zero_centered), r


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   group_size: int | None = None, norm_before_gate: bool = True) -> torch.Tensor:
    if use_triton(x):
        from armillary.kernels.triton.norm import gated_rms_norm as tri

        if x.dim() in (2, 3) and group_size is None:  # strided [T, H, D] views are read in place
            return tri(x, gate, weight, eps, None, norm_before_gate)
        d = x.shape[-1]
        return tri(x.reshape(-1, d), gate.reshape(-1, d), weight, eps, group_size, norm_before_gate).view(x.shape)
    return _norm.gated_rms_norm(x, gate, weight, eps, group_size, norm_before_gate)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotary on the first ``2 * cos.shape[-1]`` dims of ``x: [T, H, D]``; cos, sin: [T, rot / 2]."""
    if use_triton(x):
        from armillary.kernels.triton.rotary import apply_rotary_

        x = x.contiguous()
        apply_rotary_(x, None, cos, sin, interleaved)
        return x
    return _rotary.apply_rotary(x, cos, sin, interleaved)


def softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(router_logits):
        from armillary.kernels.triton.moe_routing import topk_softmax

        return topk_softmax(router_logits, top_k, renormalize)
    return _moe.softmax_topk(router_logits, top_k, renormalize)


def softmax_topk_with_shared(router_logits: torch.Tensor, top_k: int,
                            renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing over the first ``E`` columns plus one always-on shared expert (id ``E``).

    router_logits: [T, E + 1], the last column the shared expert's gate logit -> (weights [T, k + 1]
    float32, ids [T, k + 1]); the shared expert's weight is sigmoid(gate logit).
    """
    num_experts = router_logits.shape[1] - 1
    if use_triton(router_logits):
        from armillary.kernels.triton.moe_routing import topk_softmax

        return topk_softmax(router_logits[:, :num_experts], top_k, renormalize, num_shared=1,
                            shared_gate_logits=router_logits[:, num_experts])
    weights, ids = _moe.softmax_topk(router_logits[:, :num_experts], top_k, renormalize)
    shared_w = torch.sigmoid(router_logits[:, num_experts:].float())  # [T, 1]
    shared_id = torch.full_like(ids[:, :1], num_experts)
    return torch.cat([weights, shared_w], dim=1), torch.cat([ids, shared_id], dim=1)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """Routed experts: ``x: [T, H]``, ``w13: [E, 2I or I, H]``, ``w2: [E, H, I]`` -> ``[T, H]``."""
    if use_triton(x):
        from armillary.kernels.triton.moe import fused_moe as tri

        return tri(x, w13, w2, topk_weights, topk_ids, activation)
    return _moe.fused_moe(x, w13, w2, topk_weights, topk_ids, activation)
