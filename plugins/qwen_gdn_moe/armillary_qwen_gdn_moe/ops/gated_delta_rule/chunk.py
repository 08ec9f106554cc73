"""Chunked (WY, 64-token chunks) gated delta rule in Triton over packed variable-length sequences:
the prefill path of Gated DeltaNet.

Four launches: q/k L2 norm; per chunk the cumulative decay, the inverted WY system and w, u
(chunk_intra.py); per sequence the state recurrence across chunks; per chunk the outputs
(chunk_state.py). Sequences start anywhere in the packed tensor, so the kernels walk a chunk table
built on the host from ``cu_seqlens`` once per call (pass ``cu_seqlens_cpu`` to skip reading the
offsets back from the device). Reference: ``naive.chunk_gated_delta_rule_ref``.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from armillary.kernels.triton.host import cdiv, next_power_of_2
from armillary.kernels.triton.varlen import device_offsets, host_bounds, varlen_chunks
from armillary.kernels.tuning import kernel_config
from armillary_qwen_gdn_moe.ops.gated_delta_rule.chunk_intra import chunk_intra_kernel, l2norm_qk_kernel
from armillary_qwen_gdn_moe.ops.gated_delta_rule.chunk_state import chunk_output_kernel, chunk_state_kernel

CHUNK = 64
CHUNK_DEFAULTS = {
    "norm_block_t": 16, "norm_warps": 4,
    "intra_bk": 64, "intra_bv": 64, "intra_warps": 2, "intra_stages": 1,
    "state_bv": 32, "state_warps": 4, "state_stages": 3,
    "out_bk": 64, "out_bv": 64, "out_warps": 4, "out_stages": 2,
}


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D] with each token's heads packed (any token stride); copies otherwise."""
    if x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]:
        return x
    return x.contiguous()


def _launch_config(head_k: int, head_v: int, device: torch.device, override: dict | None) -> dict:
    key = f"k{next_power_of_2(head_k)}_v{next_power_of_2(head_v)}"
    return {**kernel_config("armillary_qwen_gdn_moe", "gdn_chunk", key, CHUNK_DEFAULTS, device), **(override or {})}


def _chunk_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor | Sequence[int],
    initial_state: torch.Tensor | None,
    final_state: torch.Tensor,
    state_index: torch.Tensor | None,
    scale: float | None,
    use_qk_l2norm: bool,
    cu_seqlens_cpu: Sequence[int] | None,
    config: dict | None,
) -> torch.Tensor:
    """Runs the four kernels; final states go to final_state[state_index[n]] (or [n]). Returns o."""
    total, num_k_heads, head_k = q.shape
    num_v_heads, head_v = v.shape[1:]
    bounds = host_bounds(cu_seqlens, cu_seqlens_cpu)
    num_seqs = len(bounds) - 1
    if num_v_heads % num_k_heads or k.shape != q.shape or bounds[-1] != total \
            or g.shape != (total, num_v_heads) or beta.shape != g.shape:
        raise ValueError(
            f"chunk_gated_delta_rule: q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} g {tuple(g.shape)} "
            f"beta {tuple(beta.shape)} cu_seqlens[-1] {bounds[-1]} do not agree"
        )
    for name, state in (("initial_state", initial_state), ("final_state", final_state)):
        if state is not None and (state.shape[1:] != (num_v_heads, head_k, head_v)
                                  or state.stride()[1:] != (head_k * head_v, head_v, 1)):
            raise ValueError(
                f"chunk_gated_delta_rule: {name} {tuple(state.shape)} is not [N, HV, K, V] per-slot contiguous"
            )
    o = torch.empty(total, num_v_heads, head_v, dtype=v.dtype, device=v.device)
    if num_seqs == 0:
        return o
    device = q.device
    cfg = _launch_config(head_k, head_v, device, config)
    dtype = q.dtype
    precision = "ieee" if dtype == torch.float32 else "tf32"
    bk, bv = next_power_of_2(head_k), next_power_of_2(head_v)
    q, k, v = _rows(q), _rows(k), _rows(v)
    if use_qk_l2norm and total:
        qn = torch.empty(q.shape, dtype=dtype, device=device)
        kn = torch.empty(k.shape, dtype=dtype, device=device)
        l2norm_qk_kernel[(cdiv(total, cfg["norm_block_t"]), num_k_heads)](
            q, k, qn, kn, q.stride(0), k.stride(0), total,
            H=num_k_heads, K=head_k, BK=bk, BLOCK_T=cfg["norm_block_t"], num_warps=cfg["norm_warps"],
        )
        q, k = qn, kn
    g = g.contiguous()
    beta = beta.contiguous()
    cu = device_offsets(cu_seqlens, device)
    chunks = varlen_chunks(bounds, CHUNK, device)

    w = torch.empty(total, num_v_heads, head_k, dtype=dtype, device=device)
    u = torch.empty(total, num_v_heads, head_v, dtype=dtype, device=device)
    g_cum = torch.empty(total, num_v_heads, dtype=torch.float32, device=device)
    dims = dict(H=num_k_heads, HV=num_v_heads, K=head_k, V=head_v, BT=CHUNK, DOT_PRECISION=precision)
    if chunks.num_chunks:  # an all-empty batch only carries its states over (the state kernel)
        chunk_intra_kernel[(chunks.num_chunks, num_v_heads)](
            k, v, g, beta, cu, chunks.table, w, u, g_cum, k.stride(0), v.stride(0),
            BK=min(cfg["intra_bk"], bk), BV=min(cfg["intra_bv"], bv), **dims,
            num_warps=cfg["intra_warps"], num_stages=cfg["intra_stages"],
        )

    chunk_states = torch.empty(chunks.num_chunks, num_v_heads, head_k, head_v, dtype=dtype, device=device)
    deltas = torch.empty_like(u)
    state_bv = min(cfg["state_bv"], bv)
    chunk_state_kernel[(cdiv(head_v, state_bv), num_seqs * num_v_heads)](
        k, w, u, g_cum, cu, chunks.first_chunk,
        initial_state if initial_state is not None else final_state, final_state,
        state_index if state_index is not None else cu, chunk_states, deltas, k.stride(0),
        (initial_state if initial_state is not None else final_state).stride(0), final_state.stride(0),
        BK=bk, BV=state_bv, HAS_INITIAL=initial_state is not None, HAS_INDEX=state_index is not None, **dims,
        num_warps=cfg["state_warps"], num_stages=cfg["state_stages"],
    )

    if not chunks.num_chunks:
        return o
    out_bv = min(cfg["out_bv"], bv)
    chunk_output_kernel[(cdiv(head_v, out_bv), chunks.num_chunks, num_v_heads)](
        q, k, deltas, chunk_states, g_cum, cu, chunks.table, o, q.stride(0), k.stride(0),
        head_k**-0.5 if scale is None else scale,
        BK=min(cfg["out_bk"], bk), BV=out_bv, **dims,
        num_warps=cfg["out_warps"], num_stages=cfg["out_stages"],
    )
    return o


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor | Sequence[int],
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    cu_seqlens_cpu: Sequence[int] | None = None,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked gated delta rule over packed sequences, same contract as ``chunk_gated_delta_rule_ref``.

    q, k: [T, H, K]; v: [T, HV, V] (HV a multiple of H; k-head h serves v-heads h·HV/H ..); any
    token stride, heads packed (e.g. views into the conv output); g: [T, HV] fp32 log decay (<= 0);
    beta: [T, HV]; cu_seqlens: [B+1] offsets (device int32 tensor, or host ints) — the chunk table
    is built on the host once per call, from ``cu_seqlens_cpu`` when given, else by reading
    ``cu_seqlens`` back (a sync); initial_state: [B, HV, K, V] or None (zeros); scale defaults to
    K^-0.5; q and k are L2-normalised first when ``use_qk_l2norm``. Intermediates are kept in q's
    dtype (fp32 for fp32 inputs). Returns (o [T, HV, V] in v's dtype, final_state [B, HV, K, V] fp32).
    """
    bounds = host_bounds(cu_seqlens, cu_seqlens_cpu)
    final = torch.empty(len(bounds) - 1, v.shape[1], q.shape[2], v.shape[2], dtype=torch.float32, device=q.device)
    o = _chunk_forward(q, k, v, g, beta, cu_seqlens, initial_state, final, None, scale, use_qk_l2norm, bounds, config)
    return o, final


def chunk_gated_delta_rule_slots(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor | Sequence[int],
    ssm_states: torch.Tensor,
    state_slots: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    cu_seqlens_cpu: Sequence[int] | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """``chunk_gated_delta_rule`` starting from ``ssm_states[state_slots[n]]`` ([slots, HV, K, V]
    fp32) and writing each final state back there in place (slots distinct). Returns o [T, HV, V]."""
    if ssm_states.dtype != torch.float32:
        raise ValueError(f"chunk_gated_delta_rule_slots: ssm_states must be float32, got {ssm_states.dtype}")
    return _chunk_forward(q, k, v, g, beta, cu_seqlens, ssm_states, ssm_states, state_slots, scale, use_qk_l2norm,
                          host_bounds(cu_seqlens, cu_seqlens_cpu), config)
