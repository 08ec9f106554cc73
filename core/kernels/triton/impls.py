"""Core's Triton kernels in the kernel interfaces' signatures: thin adapters over each kernel's wrapper.

Each adapter imports its kernel module when first called and looks the wrapper up on the module
at call time (so benchmarks and tests can swap one). ``supports_*`` are the per-call checks of
the kernels that take only some calls (registered as ``supports`` in core_plugin).
"""
from __future__ import annotations

import torch

from armillary.forward_batch import ForwardBatch, KVCache


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    from armillary.kernels.triton import skinny_gemm as sg

    return sg.skinny_gemm(x, weight, bias)


def supports_linear(device: torch.device, dtype: torch.dtype | None, *, tuned_only: bool = True, rows: int = 0,
                    n: int = 0, k: int = 0, layout_ok: bool = True, **_: object) -> bool:
    """Decode-sized rows (the table's ``max_rows``) of 2-D, unit-stride, one-dtype operands; under
    ``tuned_only`` only the shapes the target's table marks ``"use": true`` (beats cuBLAS)."""
    if dtype is None:
        return True  # any device Triton runs on
    if not layout_ok or rows == 0:
        return False
    from armillary.kernels.triton import skinny_gemm as sg

    cfg = sg.lookup_config(rows, n, k, device)
    return rows <= cfg["max_rows"] and (cfg["use"] or not tuned_only)


def store_kv(cache: KVCache, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> None:
    from armillary.kernels.triton import kv_cache

    kv_cache.write_kv_cache(k, v, cache.k, cache.v, batch.slot_mapping_of(cache), cache.k_scale, cache.v_scale)


def paged_attention_decode(q: torch.Tensor, cache: KVCache, batch: ForwardBatch, scale: float,
                           sliding_window: int | None, softcap: float | None,
                           gate: torch.Tensor | None) -> torch.Tensor:
    from armillary.kernels.triton import paged_attention as tri

    return tri.paged_attention_decode(q, cache.k, cache.v, batch.block_tables_of(cache), batch.seq_lens, scale,
                                      sliding_window, softcap, max_seq_len=batch.max_seq_len, gate=gate,
                                      k_scale=cache.k_scale, v_scale=cache.v_scale)


def paged_attention_prefill(q: torch.Tensor, cache: KVCache, batch: ForwardBatch, scale: float,
                            sliding_window: int | None, softcap: float | None,
                            gate: torch.Tensor | None) -> torch.Tensor:
    from armillary.kernels.triton import paged_attention as tri

    return tri.paged_attention_prefill(q, cache.k, cache.v, batch.block_tables_of(cache), batch.query_start_loc,
                                       batch.seq_lens, batch.max_query_len, scale, sliding_window, softcap,
                                       max_seq_len=batch.max_seq_len, gate=gate, k_scale=cache.k_scale,
                                       v_scale=cache.v_scale)


def qk_norm_rope_store(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                       k_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                       batch: ForwardBatch, zero_centered: bool) -> torch.Tensor:
    from armillary.kernels.triton import qk_norm_rope

    return qk_norm_rope.qk_norm_rope_store(query, k, v, q_weight, k_weight, eps, cos, sin, cache.k, cache.v,
                                           batch.slot_mapping_of(cache), zero_centered, k_scale=cache.k_scale,
                                           v_scale=cache.v_scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    from armillary.kernels.triton import norm

    return norm.rms_norm(x, weight, eps, zero_centered)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 zero_centered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from armillary.kernels.triton import norm

    return norm.fused_add_rms_norm(x, residual, weight, eps, zero_centered)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int | None,
                   norm_before_gate: bool) -> torch.Tensor:
    from armillary.kernels.triton import norm

    if x.dim() in (2, 3) and group_size is None:  # strided [T, H, D] views are read in place
        return norm.gated_rms_norm(x, gate, weight, eps, None, norm_before_gate)
    d = x.shape[-1]
    return norm.gated_rms_norm(x.reshape(-1, d), gate.reshape(-1, d), weight, eps, group_size,
                               norm_before_gate).view(x.shape)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    from armillary.kernels.triton import rotary as tri

    x = x.contiguous()
    tri.apply_rotary_(x, None, cos, sin, interleaved)
    return x


def softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                 shared_gate: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from armillary.kernels.triton import moe_routing

    if not shared_gate:
        return moe_routing.topk_softmax(router_logits, top_k, renormalize)
    num_experts = router_logits.shape[1] - 1
    return moe_routing.topk_softmax(router_logits[:, :num_experts], top_k, renormalize, num_shared=1,
                                    shared_gate_logits=router_logits[:, num_experts])


def sigmoid_topk(router_logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, renormalize: bool,
                 scaling: float, num_shared: int, n_group: int = 1,
                 topk_group: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    from armillary.kernels.triton import moe_routing

    return moe_routing.topk_sigmoid_bias(router_logits, bias, top_k, renormalize, scaling, num_shared,
                                         n_group=n_group, topk_group=topk_group)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: str) -> torch.Tensor:
    from armillary.kernels.triton import moe

    return moe.fused_moe(x, w13, w2, topk_weights, topk_ids, activation)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_states: torch.Tensor,
                  state_slots: torch.Tensor, batch: ForwardBatch, activation: str | None) -> torch.Tensor:
    from armillary.kernels.triton import causal_conv1d as tri

    return tri.causal_conv1d_prefill(x, weight, bias, conv_states, state_slots, batch.query_start_loc,
                                     activation=activation, cu_seqlens_cpu=batch.query_start_loc_cpu)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int,
               bias: torch.Tensor | None, tail: torch.Tensor | None = None) -> torch.Tensor:
    from armillary.kernels.triton import fp8_gemm

    return fp8_gemm.fp8_linear(x, weight, scale, block_n, block_k, bias, tail=tail)


def fp8_fused_moe(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                  block_n: int, block_k: int, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  activation: str) -> torch.Tensor:
    from armillary.kernels.triton import fp8_moe

    return fp8_moe.fp8_fused_moe(x, w13, s13, w2, s2, block_n, block_k, topk_weights, topk_ids, activation)


def fp4_linear(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, global_scale: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
    from armillary.kernels.triton import fp4_gemm

    return fp4_gemm.fp4_linear(x, w_packed, w_scale, global_scale, bias)


def fp4_linear_blackwell(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, global_scale: torch.Tensor,
                         bias: torch.Tensor | None) -> torch.Tensor:
    from armillary.kernels.triton import fp4_blackwell

    return fp4_blackwell.fp4_linear(x, w_packed, w_scale, global_scale, bias)


def fp4_fused_moe(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, g13: torch.Tensor, w2: torch.Tensor,
                  s2: torch.Tensor, g2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  activation: str) -> torch.Tensor:
    from armillary.kernels.triton import fp4_moe

    return fp4_moe.fp4_fused_moe(x, w13, s13, g13, w2, s2, g2, topk_weights, topk_ids, activation)
