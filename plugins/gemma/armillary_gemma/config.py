"""The Gemma 3 / Gemma 4 ``config.json`` fields the models read, resolved per layer and checked once.

Reads both spellings checkpoints ship: transformers 5's (``rope_parameters`` per layer type,
Gemma 4's ``per_layer_config``) and the published one (``rope_theta`` + ``rope_local_base_freq`` +
``rope_scaling``, ``sliding_window_pattern``; Gemma 4's ``global_head_dim`` /
``num_global_key_value_heads``). Missing fields take transformers' ``Gemma3TextConfig`` /
``Gemma4TextConfig`` defaults, as the published multimodal configs leave many out.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from armillary.hf_config import HFConfig

SLIDING, FULL = "sliding_attention", "full_attention"
_GEMMA3 = dict(vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
               num_attention_heads=8, num_key_value_heads=4, head_dim=256, sliding_window=4096,
               query_pre_attn_scalar=256, max_position_embeddings=131_072)
_GEMMA4 = dict(vocab_size=262_144, hidden_size=2304, intermediate_size=9216, num_hidden_layers=30,
               num_attention_heads=8, num_key_value_heads=4, head_dim=256, sliding_window=512,
               vocab_size_per_layer_input=262_144, hidden_size_per_layer_input=256, global_head_dim=512,
               max_position_embeddings=131_072)


@dataclass(frozen=True, slots=True)
class RopeArgs:
    rope_type: str  # "default" | "linear" | "proportional"
    theta: float
    factor: float = 1.0
    partial_rotary_factor: float = 1.0


@dataclass(frozen=True, slots=True)
class LayerArgs:
    kind: str  # SLIDING or FULL
    head_dim: int
    num_kv_heads: int
    window: int | None
    kv_source: int  # the layer whose KV cache this one reads: itself, or the producer it shares with
    k_eq_v: bool  # values are the (unnormed) key projection: no v_proj
    intermediate_size: int


@dataclass(frozen=True, slots=True)
class MoEArgs:
    num_experts: int
    top_k: int
    intermediate_size: int


@dataclass(frozen=True, slots=True)
class GemmaArgs:
    version: int  # 3 or 4
    vocab_size: int
    hidden_size: int
    num_heads: int
    rms_norm_eps: float
    hidden_act: str
    attention_bias: bool
    tie_word_embeddings: bool
    scale: float  # attention score scale: query_pre_attn_scalar ** -0.5 (Gemma 3), 1 (Gemma 4: q/k normed)
    attn_softcap: float | None
    final_softcap: float | None
    rope: dict[str, RopeArgs]  # per layer type
    layers: tuple[LayerArgs, ...]
    per_layer_dim: int = 0  # Gemma 4 per-layer input embeddings (E2B / E4B); 0: none
    per_layer_vocab: int = 0
    moe: MoEArgs | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def zero_centered(self) -> bool:
        """Gemma 3 stores RMSNorm weights as offsets (x̂ · (1 + w)); Gemma 4 as scales (x̂ · w)."""
        return self.version == 3

    @classmethod
    def from_hf(cls, hf_config: HFConfig) -> GemmaArgs:
        text = hf_config.get("text_config") or hf_config
        if isinstance(text, dict):
            text = HFConfig(text)
        model_type = text.get("model_type") or hf_config.get("model_type") or ""
        version = 4 if model_type.startswith("gemma4") or "global_head_dim" in text.to_dict() \
            or "per_layer_config" in text.to_dict() else 3
        return _gemma4(text) if version == 4 else _gemma3(text)


def _get(text: HFConfig, name: str, defaults: dict):
    value = text.get(name)
    return defaults.get(name) if value is None else value


def _layer_types(text: HFConfig, num_layers: int, force_last_full: bool) -> list[str]:
    types = text.get("layer_types")
    if types is None:
        pattern = int(text.get("sliding_window_pattern") or 6)
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    types = list(types)
    if len(types) != num_layers:
        raise ValueError(f"layer_types lists {len(types)} layers, the model has {num_layers}")
    unknown = set(types) - {SLIDING, FULL}
    if unknown:
        raise ValueError(f"layer_types {sorted(unknown)} are not served by armillary-gemma")
    if force_last_full:
        types[-1] = FULL  # Gemma4TextConfig forces it too
    return types


def _as_dict(value) -> dict:
    if value is None:
        return {}
    return value.to_dict() if isinstance(value, HFConfig) else dict(value)


def _rope(params: dict, default_theta: float) -> RopeArgs:
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "linear", "proportional"):
        raise ValueError(f"RoPE type {rope_type!r} is not served by armillary-gemma")
    return RopeArgs(rope_type, float(params.get("rope_theta", default_theta)), float(params.get("factor", 1.0)),
                    float(params.get("partial_rotary_factor", 1.0)))


def _rope_per_type(text: HFConfig, local_default: float, global_default: dict) -> dict[str, RopeArgs]:
    params = _as_dict(text.get("rope_parameters"))
    if SLIDING in params or FULL in params:  # transformers 5: one entry per layer type
        return {SLIDING: _rope(_as_dict(params.get(SLIDING)) or {"rope_theta": local_default}, local_default),
                FULL: _rope(_as_dict(params.get(FULL)) or global_default, global_default["rope_theta"])}
    scaling = _as_dict(text.get("rope_scaling")) or params  # published: rope_theta, rope_local_base_freq, scaling
    full = {**global_default, "rope_theta": text.get("rope_theta") or params.get("rope_theta")
            or global_default["rope_theta"], **{k: v for k, v in scaling.items() if k != "rope_theta"}}
    local = text.get("rope_local_base_freq") or local_default
    return {SLIDING: RopeArgs("default", float(local)), FULL: _rope(full, global_default["rope_theta"])}


def _window(text: HFConfig, defaults: dict) -> int:
    window = _get(text, "sliding_window", defaults)
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ValueError(f"sliding_window must be a positive int, not {window!r}")
    # "vision" (Gemma 4 multimodal) only widens attention among image tokens: text-only it is causal
    if text.get("use_bidirectional_attention") in (True, "all"):
        raise ValueError("use_bidirectional_attention (embedding checkpoints) is not served by armillary-gemma")
    return window


def _common(text: HFConfig, defaults: dict) -> dict:
    return dict(vocab_size=_get(text, "vocab_size", defaults), hidden_size=_get(text, "hidden_size", defaults),
                num_heads=_get(text, "num_attention_heads", defaults),
                rms_norm_eps=float(text.get("rms_norm_eps") or 1e-6),
                hidden_act=text.get("hidden_activation") or text.get("hidden_act") or "gelu_pytorch_tanh",
                attention_bias=bool(text.get("attention_bias", False)),
                tie_word_embeddings=bool(text.get("tie_word_embeddings", True)),
                final_softcap=text.get("final_logit_softcapping"))


def _gemma3(text: HFConfig) -> GemmaArgs:
    num_layers = _get(text, "num_hidden_layers", _GEMMA3)
    types = _layer_types(text, num_layers, force_last_full=False)
    window, head_dim = _window(text, _GEMMA3), _get(text, "head_dim", _GEMMA3)
    kv_heads, inter = _get(text, "num_key_value_heads", _GEMMA3), _get(text, "intermediate_size", _GEMMA3)
    layers = tuple(LayerArgs(kind, head_dim, kv_heads, window if kind == SLIDING else None, i, False, inter)
                   for i, kind in enumerate(types))
    rope = _rope_per_type(text, 10_000.0, {"rope_type": "default", "rope_theta": 1_000_000.0})
    return GemmaArgs(version=3, scale=float(_get(text, "query_pre_attn_scalar", _GEMMA3)) ** -0.5,
                     attn_softcap=text.get("attn_logit_softcapping"), rope=rope, layers=layers,
                     **_common(text, _GEMMA3))


def _global_overrides(text: HFConfig, types: list[str]) -> dict[int, tuple[int, int]]:
    """Per full-attention layer (head_dim, kv heads), as Gemma4TextConfig resolves them."""
    kv_heads = _get(text, "num_key_value_heads", _GEMMA4)
    per_layer = _as_dict(text.get("per_layer_config"))
    if per_layer:  # transformers 5.24+ writes the resolved values per layer index
        out = {}
        for key, entry in per_layer.items():
            entry = _as_dict(entry)
            out[int(key)] = (int(entry.get("head_dim") or _get(text, "head_dim", _GEMMA4)),
                             int(entry.get("num_key_value_heads") or kv_heads))
        return out
    head_dim = _get(text, "global_head_dim", _GEMMA4)
    global_kv = text.get("num_global_key_value_heads")
    heads = global_kv if (text.get("attention_k_eq_v", False) and global_kv is not None) else kv_heads
    return {i: (head_dim, heads) for i, kind in enumerate(types) if kind == FULL}


def _kv_sources(types: list[str], num_shared: int) -> list[int]:
    """Each layer's cache owner: itself, or (the last ``num_shared`` layers) the last earlier layer of its type."""
    n = len(types)
    if not 0 <= num_shared < n:
        raise ValueError(f"num_kv_shared_layers {num_shared} must be in [0, {n})")
    first = n - num_shared
    last_of = {kind: max((i for i in range(first) if types[i] == kind), default=None) for kind in set(types)}
    sources = []
    for i, kind in enumerate(types):
        if i < first:
            sources.append(i)
        elif last_of[kind] is None:
            raise ValueError(f"layer {i} ({kind}) shares KV but no earlier layer of that type keeps any")
        else:
            sources.append(last_of[kind])
    return sources


def _gemma4(text: HFConfig) -> GemmaArgs:
    num_layers = _get(text, "num_hidden_layers", _GEMMA4)
    types = _layer_types(text, num_layers, force_last_full=True)
    window, head_dim = _window(text, _GEMMA4), _get(text, "head_dim", _GEMMA4)
    kv_heads, inter = _get(text, "num_key_value_heads", _GEMMA4), _get(text, "intermediate_size", _GEMMA4)
    overrides = _global_overrides(text, types)
    sources = _kv_sources(types, int(text.get("num_kv_shared_layers") or 0))
    k_eq_v, double = bool(text.get("attention_k_eq_v", False)), bool(text.get("use_double_wide_mlp", False))
    layers = []
    for i, kind in enumerate(types):
        d, h = overrides.get(i, (head_dim, kv_heads))
        shared = sources[i] != i
        layers.append(LayerArgs(kind, d, h, window if kind == SLIDING else None, sources[i],
                                k_eq_v and kind == FULL, inter * (2 if double and shared else 1)))
    rope = _rope_per_type(text, 10_000.0, {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                           "rope_theta": 1_000_000.0})
    moe = None
    if text.get("enable_moe_block"):
        if not (text.get("num_experts") and text.get("top_k_experts") and text.get("moe_intermediate_size")):
            raise ValueError("enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size")
        moe = MoEArgs(int(text.num_experts), int(text.top_k_experts), int(text.moe_intermediate_size))
    per_layer_dim = int(_get(text, "hidden_size_per_layer_input", _GEMMA4) or 0)
    return GemmaArgs(version=4, scale=1.0, attn_softcap=None, rope=rope, layers=tuple(layers),
                     per_layer_dim=per_layer_dim,
                     per_layer_vocab=int(_get(text, "vocab_size_per_layer_input", _GEMMA4)) if per_layer_dim else 0,
                     moe=moe, **_common(text, _GEMMA4))


def embed_scale(dim: int) -> float:
    """``sqrt(dim)``, which Gemma rounds to the model dtype before multiplying (55.4256 -> 55.5 in bf16)."""
    return math.sqrt(dim)
