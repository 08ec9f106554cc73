"""The kernel interfaces as typed Protocols: the call signature every registered implementation of one has.

An implementation is registered (``armillary_register_kernels``) under one of these names and is
called exactly as its Protocol says, positionally, by ``armillary.kernels.ops``. Shapes use T
tokens, B sequences, H heads (Hq query, Hkv key/value), D head dim, E experts, k experts per token.

``supports(device, dtype, **shape)`` (``Supports``) is asked once when a dispatch table is resolved
(``dtype`` None, no shape: can it run on this device at all?) and, for an implementation that has
one, again on each call with the facts ``SHAPE_INFO[interface]`` takes from the call's arguments.
Interfaces in ``DECLINES`` let an implementation return None to pass the call to the next one.
A plugin may register implementations of interfaces of its own (e.g. ``gated_delta_rule``).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from armillary.forward_batch import ForwardBatch, KVCache


class Supports(Protocol):
    def __call__(self, device: torch.device, dtype: torch.dtype | None, *, tuned_only: bool = True,
                 **shape: Any) -> bool:
        """Whether the implementation takes a call on ``device`` (and ``dtype`` / ``shape`` when given).

        ``tuned_only``: True under the "auto" backend (take only what the tuning tables say it wins),
        False under "triton" (take whatever it can compute)."""


class Linear(Protocol):
    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ weight.T + bias``: x [M, K], weight [N, K], bias [N] or None -> [M, N] in x's dtype."""


class StoreKV(Protocol):
    def __call__(self, cache: KVCache, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> None:
        """Write k [T, Hkv, D] and v [T, Hkv, Dv] into ``cache`` at ``batch.slot_mapping_of(cache)`` [T]."""


class PagedAttention(Protocol):
    def __call__(self, q: torch.Tensor, cache: KVCache, batch: ForwardBatch, scale: float,
                 sliding_window: int | None, softcap: float | None, gate: torch.Tensor | None) -> torch.Tensor:
        """Causal attention of q [T, Hq, D] over each sequence's cached K/V (the step's own already stored).

        Block tables: ``batch.block_tables_of(cache)`` [B, max_blocks]. ``gate`` [T, Hq, Dv] or None:
        the output is then ``attn · sigmoid(gate)``. Returns [T, Hq, Dv]. The decode interface gets
        one token per sequence (``batch.is_decode_only``), the prefill one any mix."""


class FreshPrefillAttention(Protocol):
    def __call__(self, q: torch.Tensor, cache: KVCache, batch: ForwardBatch, scale: float,
                 sliding_window: int | None, softcap: float | None,
                 gate: torch.Tensor | None) -> torch.Tensor | None:
        """As ``PagedAttention`` for steps whose sequences have nothing cached before them; None declines."""


class QKNormRopeStore(Protocol):
    def __call__(self, query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                 k_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                 batch: ForwardBatch, zero_centered: bool) -> torch.Tensor:
        """Per-head RMSNorm of query [T, Hq, D] and k [T, Hkv, D], neox rotary on their first
        ``2 * cos.shape[-1]`` dims (cos, sin: [T, rot / 2]), k and v [T, Hkv, Dv] stored; returns q [T, Hq, D]."""


class RMSNorm(Protocol):
    def __call__(self, x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
        """x [..., D] (strided [T, H, D] views allowed) normalised over D, times weight [D] (or 1 + weight)."""


class AddRMSNorm(Protocol):
    def __call__(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 zero_centered: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """r = x + residual (x, residual [T, D], r rounded to the dtype); returns (rms_norm(r) [T, D], r)."""


class GatedRMSNorm(Protocol):
    def __call__(self, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                 group_size: int | None, norm_before_gate: bool) -> torch.Tensor:
        """x, gate [..., D]; rms_norm(x) · silu(gate) (or rms_norm(x · silu(gate))), per ``group_size`` groups."""


class Rotary(Protocol):
    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
        """x [T, H, D] rotated on its first ``2 * cos.shape[-1]`` dims (cos, sin: [T, rot / 2]); returns [T, H, D]."""


class SoftmaxTopK(Protocol):
    def __call__(self, router_logits: torch.Tensor, top_k: int, renormalize: bool,
                 shared_gate: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """router_logits [T, E] (or [T, E + 1] with ``shared_gate``: the last column a shared expert's gate)
        -> (weights [T, k] float32, ids [T, k]); with ``shared_gate`` one more column: expert E, weight
        sigmoid(gate logit)."""


class SigmoidTopK(Protocol):
    def __call__(self, router_logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, renormalize: bool,
                 scaling: float, num_shared: int, n_group: int = 1,
                 topk_group: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Sigmoid router: the top k of sigmoid(logits [T, E]) + bias [E] chosen, their unbiased scores
        (renormalised if asked) times ``scaling`` -> (weights [T, k + S] float32, ids [T, k + S]); the S =
        ``num_shared`` extra columns are experts E.. with weight 1. ``n_group`` > 1: only experts of the
        ``topk_group`` groups with the best top-2 sums are eligible (passed only then, by keyword)."""


class FusedMoE(Protocol):
    def __call__(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, activation: str) -> torch.Tensor:
        """x [T, H], w13 [E, 2I, H] ([gate | up]) or [E, I, H], w2 [E, H, I], topk_* [T, k] -> [T, H]."""


class Fp8Linear(Protocol):
    def __call__(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int,
                 bias: torch.Tensor | None, tail: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ (weight · scale).T + bias``: x [M, K], weight float8_e4m3fn [N, K], scale fp32
        [ceil(N / block_n), ceil(K / block_k)] (multiplied in), bias [N] or None -> [M, N] in x's dtype;
        ``tail`` [N_t, K] in x's dtype: unquantized rows after the fp8 ones, in the same output
        ([M, N + N_t], bias [N + N_t])."""


class Fp8FusedMoE(Protocol):
    def __call__(self, x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                 block_n: int, block_k: int, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 activation: str) -> torch.Tensor:
        """``FusedMoE`` over fp8 experts w13 [E, 2I or I, H], w2 [E, H, I] with block scales s13
        [E, ceil(2I / bn), ceil(H / bk)], s2 [E, ceil(H / bn), ceil(I / bk)] -> [T, H]."""


class Fp4Linear(Protocol):
    def __call__(self, x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, global_scale: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W.T + bias`` for an NVFP4 weight W [N, K] (weight-only: x stays in its dtype).

        x [M, K] bf16 / fp16 / fp32 (K a multiple of 16); ``w_packed`` uint8 [N, K / 2], two e2m1 codes
        per byte: column 2j in the low nibble, 2j + 1 in the high one; a code is sign bit 3, magnitude
        bits 0-2 into (0, 0.5, 1, 1.5, 2, 3, 4, 6). ``w_scale`` float8_e4m3fn [N, K / 16] (one per row and
        16 columns); ``global_scale`` fp32 [N] (one per output row). W[n, k] = e2m1 · w_scale[n, k // 16]
        · global_scale[n]. bias [N] or None -> [M, N] in x's dtype (``armillary.kernels.fp4.linear``)."""


class Fp4FusedMoE(Protocol):
    def __call__(self, x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, g13: torch.Tensor, w2: torch.Tensor,
                 s2: torch.Tensor, g2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 activation: str) -> torch.Tensor:
        """``FusedMoE`` over NVFP4 experts, each packed as ``Fp4Linear``'s weight: w13 uint8 [E, 2I or I, H / 2]
        (rows [gate | up]), s13 e4m3 [E, 2I or I, H / 16], g13 fp32 [E, 2I or I]; w2 uint8 [E, H, I / 2], s2
        [E, H, I / 16], g2 fp32 [E, H]; x [T, H], topk_* [T, k] -> [T, H] in x's dtype
        (``armillary.kernels.fp4.fused_moe``)."""


class CausalConv1d(Protocol):
    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 conv_states: torch.Tensor, state_slots: torch.Tensor, batch: ForwardBatch,
                 activation: str | None) -> torch.Tensor:
        """Depthwise causal conv over packed sequences x [T, C] (weight [C, W], bias [C]), each continuing
        from its slot's window conv_states [slots, C, W - 1] (updated); returns [T, C]."""


INTERFACES: dict[str, type] = {
    "linear": Linear,
    "store_kv": StoreKV,
    "paged_attention_decode": PagedAttention,
    "paged_attention_prefill": PagedAttention,
    "fresh_prefill_attention": FreshPrefillAttention,
    "qk_norm_rope_store": QKNormRopeStore,
    "rms_norm": RMSNorm,
    "add_rms_norm": AddRMSNorm,
    "gated_rms_norm": GatedRMSNorm,
    "rotary": Rotary,
    "softmax_topk": SoftmaxTopK,
    "sigmoid_topk": SigmoidTopK,
    "fused_moe": FusedMoE,
    "causal_conv1d": CausalConv1d,
    "fp8_linear": Fp8Linear,
    "fp8_fused_moe": Fp8FusedMoE,
    "fp4_linear": Fp4Linear,
    "fp4_fused_moe": Fp4FusedMoE,
}
DECLINES = frozenset({"fresh_prefill_attention"})


def _linear_info(x, weight, bias) -> tuple[torch.device, torch.dtype, dict]:
    layout_ok = (x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1] and x.stride(1) == 1
                 and weight.stride(1) == 1 and weight.dtype == x.dtype
                 and (bias is None or (bias.dtype == x.dtype and bias.dim() == 1 and bias.is_contiguous())))
    return x.device, x.dtype, dict(rows=x.shape[0], n=weight.shape[0], k=weight.shape[-1], layout_ok=layout_ok)


def _attention_info(q, cache, batch, scale, sliding_window, softcap, gate) -> tuple[torch.device, torch.dtype, dict]:
    return q.device, q.dtype, dict(decode_only=batch.is_decode_only, sliding_window=sliding_window,
                                   softcap=softcap, context_lens=batch.context_lens_cpu,
                                   query_start_loc=batch.query_start_loc_cpu)


def _first_tensor_info(*args) -> tuple[torch.device, torch.dtype, dict]:
    x = args[0]
    return x.device, x.dtype, {}


def _store_info(cache, k, *args) -> tuple[torch.device, torch.dtype, dict]:
    return k.device, cache.k.dtype, {}


# call arguments -> (device, dtype, shape facts) for per-call supports() checks
SHAPE_INFO: dict[str, Callable[..., tuple[torch.device, torch.dtype, dict]]] = {
    "linear": _linear_info,
    "fresh_prefill_attention": _attention_info,
    "paged_attention_decode": _attention_info,
    "paged_attention_prefill": _attention_info,
    "store_kv": _store_info,
}


def shape_info(interface: str) -> Callable[..., tuple[torch.device, torch.dtype, dict]]:
    return SHAPE_INFO.get(interface, _first_tensor_info)
