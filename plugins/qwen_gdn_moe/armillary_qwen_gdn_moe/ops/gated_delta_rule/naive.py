"""Reference gated delta rule, chunked (WY form) and recurrent, float32, over packed varlen input.

Per value head with state S: [K, V], each token t does
    S <- exp(g_t) · S
    u_t = beta_t · (v_t - S^T k_t)          (the delta: what S does not yet predict)
    S <- S + k_t u_t^T
    o_t = S^T q_t
with q, k L2-normalised (optionally) and q scaled by ``scale``. Query/key heads ``H`` may be
fewer than value heads ``HV``: k-head ``h`` serves value heads ``h·HV/H .. (h+1)·HV/H - 1``.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def _l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # eps inside the root, as FLA and transformers do
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: Sequence[int] | torch.Tensor,
    initial_state: torch.Tensor | None,
    scale: float | None,
    use_qk_l2norm: bool,
) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Checks shapes; returns bounds and float32 head-major tensors [HV, T, *] plus the states."""
    bounds = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    total, num_k_heads, head_k = q.shape
    num_v_heads, head_v = v.shape[1:]
    if num_v_heads % num_k_heads:
        raise ValueError(f"value heads {num_v_heads} must be a multiple of key heads {num_k_heads}")
    if bounds[-1] != total or k.shape != q.shape or g.shape != (total, num_v_heads) or beta.shape != g.shape:
        raise ValueError(
            f"gated delta rule: q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} g {tuple(g.shape)} "
            f"beta {tuple(beta.shape)} cu_seqlens[-1] {bounds[-1]} do not agree"
        )
    num_seqs = len(bounds) - 1
    if initial_state is None:
        state = q.new_zeros(num_seqs, num_v_heads, head_k, head_v, dtype=torch.float32)
    else:
        state = initial_state.to(torch.float32).clone()
    repeat = num_v_heads // num_k_heads
    qf = q.float().repeat_interleave(repeat, dim=1)  # [T, HV, K]
    kf = k.float().repeat_interleave(repeat, dim=1)
    if use_qk_l2norm:
        qf, kf = _l2_normalize(qf), _l2_normalize(kf)
    qf = qf * (head_k**-0.5 if scale is None else scale)
    heads_first = [t.transpose(0, 1) for t in (qf, kf, v.float())]  # [HV, T, *]
    return bounds, *heads_first, g.float().transpose(0, 1), beta.float().transpose(0, 1), state


def recurrent_gated_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: Sequence[int] | torch.Tensor,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token at a time (the decode path).

    q, k: [T, H, K]; v: [T, HV, V]; g: [T, HV] log decay (<= 0); beta: [T, HV];
    cu_seqlens: B+1 offsets; initial_state: [B, HV, K, V] or None (zeros); scale defaults to K^-0.5.
    Returns (o [T, HV, V] in v's dtype, final_state [B, HV, K, V] float32).
    """
    bounds, qh, kh, vh, gh, bh, state = _prepare(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm)
    out = torch.empty_like(vh)  # [HV, T, V]
    for seq in range(len(bounds) - 1):
        s = state[seq]  # [HV, K, V]
        for t in range(bounds[seq], bounds[seq + 1]):
            s = s * gh[:, t].exp()[:, None, None]
            predicted = (s * kh[:, t, :, None]).sum(dim=1)  # S^T k: [HV, V]
            delta = bh[:, t, None] * (vh[:, t] - predicted)  # [HV, V]
            s = s + kh[:, t, :, None] * delta[:, None, :]
            out[:, t] = (s * qh[:, t, :, None]).sum(dim=1)
        state[seq] = s
    return out.transpose(0, 1).to(v.dtype), state


def chunk_gated_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: Sequence[int] | torch.Tensor,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    chunk_size: int = 64,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunks of ``chunk_size`` tokens solved at once in WY form (the prefill path); same contract as
    ``recurrent_gated_delta_rule_ref``.

    Inside a chunk with cumulative log decay c_i and start state S0, the deltas U solve the unit
    lower-triangular system (I + A) U = beta·V - beta·exp(c)·K S0 with
    A_ij = beta_i exp(c_i - c_j) k_i·k_j (j < i); then
    O = exp(c)·Q S0 + (exp(c_i - c_j) q_i·k_j)_{j<=i} U and S = exp(c_L) S0 + (exp(c_L - c)·K)^T U.
    """
    bounds, qh, kh, vh, gh, bh, state = _prepare(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm)
    out = torch.empty_like(vh)  # [HV, T, V]
    for seq in range(len(bounds) - 1):
        s = state[seq]  # [HV, K, V]
        for start in range(bounds[seq], bounds[seq + 1], chunk_size):
            end = min(start + chunk_size, bounds[seq + 1])
            qc, kc, vc, bc = qh[:, start:end], kh[:, start:end], vh[:, start:end], bh[:, start:end]
            cum = gh[:, start:end].cumsum(dim=-1)  # [HV, L]
            n = end - start
            causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            # exp(c_i - c_j) for j <= i; masked before exp so the upper triangle cannot overflow
            decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~causal, float("-inf")).exp()  # [HV, L, L]
            strict = (bc[:, :, None] * (kc @ kc.transpose(1, 2)) * decay).tril(-1)
            system = strict + torch.eye(n, dtype=strict.dtype, device=strict.device)
            w_v = torch.linalg.solve_triangular(system, bc[..., None] * vc, upper=False, unitriangular=True)
            w_k = torch.linalg.solve_triangular(
                system, (bc * cum.exp())[..., None] * kc, upper=False, unitriangular=True
            )
            deltas = w_v - w_k @ s  # [HV, L, V]
            attn = (qc @ kc.transpose(1, 2)) * decay  # [HV, L, L]
            out[:, start:end] = (cum.exp()[..., None] * qc) @ s + attn @ deltas
            last = cum[:, -1:]  # [HV, 1]
            s = last.exp()[..., None] * s + ((last - cum).exp()[..., None] * kc).transpose(1, 2) @ deltas
        state[seq] = s
    return out.transpose(0, 1).to(v.dtype), state
