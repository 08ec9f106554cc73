"""The kernel calls models make, each through the process's dispatch table (``armillary.kernels.dispatch``).

An engine resolves a table for its architecture and device and ``install``s it (one engine per
process; the next install replaces it). Until then, and after ``set_backend``, each call uses a
default table of core's kernels for its tensor's device type: Triton on CUDA, the plain-torch
references elsewhere ("auto"); ``set_backend("reference")`` forces the references on CUDA too
(the oracle for fast-path tests; the engine then runs eagerly, since the reference attention
reads host-side batch lists); ``set_backend("triton")`` forces the Triton kernels on every device
(on the CPU under ``TRITON_INTERPRET=1``: a whole model through the fast path in CI).
"""
from __future__ import annotations

import torch

from armillary.forward_batch import ForwardBatch, KVCache
from armillary.kernels import tuning
from armillary.kernels.dispatch import BACKENDS, DispatchTable, core_registry, resolve_dispatch

_BACKENDS = BACKENDS
_backend = "auto"
_installed: DispatchTable | None = None
_defaults: dict[bool, DispatchTable] = {}  # is_cuda -> core's table for the current backend


def install(table: DispatchTable | None) -> None:
    """Make ``table`` the process's dispatch (and its tuning packages the tables' overlay); None: defaults."""
    global _installed
    _installed = table
    tuning.use_packages(table.tuning_packages if table is not None else ())
    tuning.use_architecture(table.arch_name if table is not None else None)


def set_backend(name: str) -> None:
    """Drop any installed table; calls use core's default tables under backend ``name``."""
    global _backend
    if name not in _BACKENDS:
        raise ValueError(f"kernel backend must be one of {_BACKENDS}, not {name!r}")
    _backend = name
    _defaults.clear()
    install(None)


def get_backend() -> str:
    return _installed.backend if _installed is not None else _backend


def _default_table(is_cuda: bool) -> DispatchTable:
    table = _defaults.get(is_cuda)
    if table is None:
        device = torch.device("cuda") if is_cuda else torch.device("cpu")
        table = _defaults[is_cuda] = resolve_dispatch(core_registry(), None, device, _backend)
    return table


def active_table(x: torch.Tensor | None = None) -> DispatchTable:
    """The installed table, else the default for ``x``'s device type (CPU without ``x``)."""
    if _installed is not None:
        return _installed
    return _default_table(x is not None and x.is_cuda)


def _calls(x: torch.Tensor) -> dict:
    table = _installed
    if table is None:
        table = _defaults.get(x.is_cuda) or _default_table(x.is_cuda)
    return table.calls


def use_triton(x: torch.Tensor) -> bool:
    """Whether Triton kernels serve this tensor's device under the active dispatch (plugins' own kernels)."""
    return active_table(x).triton


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``: x [M, K], weight [N, K] (nn.Linear's) -> [M, N].

    Decode-sized x (at most the table's ``max_rows`` rows) takes the Triton skinny GEMM where the
    target's tuning table says it beats cuBLAS (always, under the forced "triton" backend);
    prefill, other layouts and the CPU reference take ``F.linear``.
    """
    return _calls(x)["linear"](x, weight, bias)


def store_kv(cache: KVCache, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> None:
    """Write new keys / values ``[T, Hkv, D]`` into the paged cache at ``batch.slot_mapping_of(cache)``."""
    _calls(k)["store_kv"](cache, k, v, batch)


def attention(q: torch.Tensor, cache: KVCache, batch: ForwardBatch, scale: float,
              sliding_window: int | None = None, softcap: float | None = None,
              gate: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of the step's queries ``[T, Hq, D]`` over each sequence's cached context.

    ``gate``: optional [T, Hq, Dv] (unit last stride); the output is then ``attn · sigmoid(gate)``,
    each factor rounded to the model dtype as the unfused torch ops round them. Decode-only steps
    take ``paged_attention_decode``; others try ``fresh_prefill_attention`` (cuDNN SDPA for long
    fresh prompts on CUDA), then ``paged_attention_prefill``.
    """
    calls = _calls(q)
    if batch.is_decode_only:
        return calls["paged_attention_decode"](q, cache, batch, scale, sliding_window, softcap, gate)
    out = calls["fresh_prefill_attention"](q, cache, batch, scale, sliding_window, softcap, gate)
    if out is not None:
        return out
    return calls["paged_attention_prefill"](q, cache, batch, scale, sliding_window, softcap, gate)


def qk_norm_rope_store(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                       k_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                       batch: ForwardBatch, zero_centered: bool = True) -> torch.Tensor:
    """Per-head RMSNorm of q and k, neox rotary on their first ``2 * cos.shape[-1]`` dims, K/V store.

    query: [T, Hq, D], k: [T, Hkv, D], v: [T, Hkv, Dv] (views of the qkv projection); cos, sin:
    [T, rotary_dim / 2]. Writes k (normed, rotated) and v to ``cache`` at ``batch.slot_mapping``;
    returns q [T, Hq, D]. One launch on Triton; otherwise the unfused reference ops.
    """
    return _calls(query)["qk_norm_rope_store"](query, k, v, q_weight, k_weight, eps, cos, sin, cache, batch,
                                               zero_centered)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False) -> torch.Tensor:
    return _calls(x)["rms_norm"](x, weight, eps, zero_centered)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 zero_centered: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``r = x + residual`` (rounded to the model dtype) and ``rms_norm(r)``; returns (normed, r)."""
    return _calls(x)["add_rms_norm"](x, residual, weight, eps, zero_centered)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   group_size: int | None = None, norm_before_gate: bool = True) -> torch.Tensor:
    return _calls(x)["gated_rms_norm"](x, gate, weight, eps, group_size, norm_before_gate)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotary on the first ``2 * cos.shape[-1]`` dims of ``x: [T, H, D]``; cos, sin: [T, rot / 2]."""
    return _calls(x)["rotary"](x, cos, sin, interleaved)


def softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] float32, ids [T, k])."""
    return _calls(router_logits)["softmax_topk"](router_logits, top_k, renormalize, False)


def softmax_topk_with_shared(router_logits: torch.Tensor, top_k: int,
                             renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing over the first ``E`` columns plus one always-on shared expert (id ``E``).

    router_logits: [T, E + 1], the last column the shared expert's gate logit -> (weights [T, k + 1]
    float32, ids [T, k + 1]); the shared expert's weight is sigmoid(gate logit).
    """
    return _calls(router_logits)["softmax_topk"](router_logits, top_k, renormalize, True)


def sigmoid_topk(router_logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, renormalize: bool,
                 scaling: float = 1.0, num_shared: int = 0, n_group: int = 1,
                 topk_group: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid router with a selection-only correction bias [E] (Nemotron-H, GLM): -> (weights [T, k + S]
    float32, ids [T, k + S]), the ``num_shared`` extra columns experts E.. with weight 1; ``n_group`` > 1
    limits the choice to the experts of the ``topk_group`` best groups (DeepSeek-V3 style)."""
    call = _calls(router_logits)["sigmoid_topk"]
    if n_group > 1:  # keyword-only when used, so implementations of the one-group signature still work
        return call(router_logits, bias, top_k, renormalize, scaling, num_shared, n_group=n_group,
                    topk_group=topk_group)
    return call(router_logits, bias, top_k, renormalize, scaling, num_shared)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """Routed experts: ``x: [T, H]``, ``w13: [E, 2I or I, H]``, ``w2: [E, H, I]`` -> ``[T, H]``."""
    return _calls(x)["fused_moe"](x, w13, w2, topk_weights, topk_ids, activation)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_states: torch.Tensor,
                  state_slots: torch.Tensor, batch: ForwardBatch, activation: str | None = "silu") -> torch.Tensor:
    """Depthwise causal conv1d of packed sequences x [T, C] (weight [C, W]) from each slot's window
    ``conv_states [slots, C, W - 1]`` (updated in place); ``state_slots`` [B]. Returns [T, C]."""
    return _calls(x)["causal_conv1d"](x, weight, bias, conv_states, state_slots, batch, activation)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int,
               bias: torch.Tensor | None = None, tail: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ (weight · scale).T + bias`` for fp8 weights [N, K] with block scales [ceil(N/bn), ceil(K/bk)]
    (per-channel: bn 1, bk K), then the unquantized ``tail`` rows [N_t, K] in the same output. Triton:
    activations quantized per token-group in the GEMM; reference: the weight dequantized into x's dtype."""
    return _calls(x)["fp8_linear"](x, weight, scale, block_n, block_k, bias, tail)


def fp8_fused_moe(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                  block_n: int, block_k: int, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  activation: str = "silu") -> torch.Tensor:
    """Routed fp8 experts (``fused_moe`` with block-scaled weights): x [T, H] -> [T, H]."""
    return _calls(x)["fp8_fused_moe"](x, w13, s13, w2, s2, block_n, block_k, topk_weights, topk_ids, activation)


def fp4_linear(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, global_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for an NVFP4 weight (packed e2m1 [N, K/2], e4m3 group scales [N, K/16], fp32
    global scale per row [N]; ``interfaces.Fp4Linear``); weight-only, x [M, K] -> [M, N] in x's dtype."""
    return _calls(x)["fp4_linear"](x, w_packed, w_scale, global_scale, bias)


def fp4_fused_moe(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, g13: torch.Tensor, w2: torch.Tensor,
                  s2: torch.Tensor, g2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  activation: str = "silu") -> torch.Tensor:
    """Routed NVFP4 experts (``fused_moe`` with ``fp4_linear``'s weight layout per expert): x [T, H] -> [T, H]."""
    return _calls(x)["fp4_fused_moe"](x, w13, s13, g13, w2, s2, g2, topk_weights, topk_ids, activation)
