"""The plain-torch reference of each kernel interface, in the interface's signature (oracle and CPU path).

Where a reference in attention / norm / moe / rotary / conv1d / fp8 / fp4 already has the
interface's signature it is registered directly (``core_plugin._REFERENCES``: e.g. ``fp4_linear``
-> ``armillary.kernels.fp4.linear``); these adapt the others. The attention references read the
batch's host lists, which a CUDA-graph batch does not carry: inside a capture they fail loudly.
"""
from __future__ import annotations

import torch

from armillary.forward_batch import ForwardBatch, KVCache
from armillary.kernels import attention as _attn
from armillary.kernels import conv1d as _conv
from armillary.kernels import moe as _moe
from armillary.kernels import norm as _norm
from armillary.kernels import rotary as _rotary


def gated(out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """``out · sigmoid(gate)`` with torch ops (out, gate: [T, H, D]); ``out`` itself without a gate."""
    if gate is None:
        return out
    return out * torch.sigmoid(gate)  # elementwise on the [T, H, D] views: no copy of the strided gate


def store_kv(cache: KVCache, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> None:
    _attn.write_kv(cache, k, v, batch.slot_mapping_of(cache))


def paged_attention(q: torch.Tensor, cache: KVCache, batch: ForwardBatch, scale: float, sliding_window: int | None,
                    softcap: float | None, gate: torch.Tensor | None) -> torch.Tensor:
    """Decode and prefill alike: per sequence over its gathered context, from the host lists."""
    if batch.seq_lens_cpu is None:
        raise RuntimeError("the reference attention reads host lists, which a CUDA-graph batch does not have")
    out = _attn.paged_attention(q, cache, batch.block_tables_of(cache), batch.query_start_loc_cpu,
                                batch.seq_lens_cpu, scale, sliding_window, softcap)
    return gated(out, gate)


def qk_norm_rope_store(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                       k_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                       batch: ForwardBatch, zero_centered: bool) -> torch.Tensor:
    q = _rotary.apply_rotary(_norm.rms_norm(query, q_weight, eps, zero_centered), cos, sin)
    k = _rotary.apply_rotary(_norm.rms_norm(k, k_weight, eps, zero_centered), cos, sin)
    _attn.write_kv(cache, k, v, batch.slot_mapping_of(cache))
    return q


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 zero_centered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    r = x + residual
    return _norm.rms_norm(r, weight, eps, zero_centered), r


def softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                 shared_gate: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if not shared_gate:
        return _moe.softmax_topk(router_logits, top_k, renormalize)
    num_experts = router_logits.shape[1] - 1
    weights, ids = _moe.softmax_topk(router_logits[:, :num_experts], top_k, renormalize)
    shared_w = torch.sigmoid(router_logits[:, num_experts:].float())  # [T, 1]
    shared_id = torch.full_like(ids[:, :1], num_experts)
    return torch.cat([weights, shared_w], dim=1), torch.cat([ids, shared_id], dim=1)


def sigmoid_topk(router_logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, renormalize: bool,
                 scaling: float, num_shared: int, n_group: int = 1,
                 topk_group: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose on sigmoid + bias (within the ``topk_group`` best of ``n_group`` groups), weigh by the plain sigmoid."""
    weights, ids = _moe.sigmoid_topk(router_logits, bias, top_k, renormalize, scaling, n_group, topk_group)
    if num_shared:
        num_tokens, num_experts = router_logits.shape
        shared_ids = torch.arange(num_experts, num_experts + num_shared, device=ids.device).expand(num_tokens, -1)
        weights = torch.cat([weights, weights.new_ones(num_tokens, num_shared)], dim=1)
        ids = torch.cat([ids, shared_ids], dim=1)
    return weights, ids


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_states: torch.Tensor,
                  state_slots: torch.Tensor, batch: ForwardBatch, activation: str | None) -> torch.Tensor:
    return _conv.causal_conv1d_varlen(x, weight, bias, conv_states, state_slots, batch.query_start_loc_cpu,
                                      activation=activation)
