"""The text-model facts of Qwen3-Next and Qwen3.5 / 3.6 (MoE and dense), read from ``config.json``.

Defaults are transformers' config defaults, used only where a config.json omits a field.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from armillary.hf_config import HFConfig

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"

# transformers' defaults per config class, where they differ between the three
QWEN3_NEXT_DEFAULTS: dict[str, Any] = dict(
    vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_key_value_heads=2, intermediate_size=5632,
    num_experts=512, num_experts_per_tok=10,
)
QWEN3_5_MOE_DEFAULTS: dict[str, Any] = dict(
    vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_key_value_heads=2, intermediate_size=0,
    num_experts=256, num_experts_per_tok=8,
)
QWEN3_5_DENSE_DEFAULTS: dict[str, Any] = dict(
    vocab_size=248320, hidden_size=4096, num_hidden_layers=32, num_key_value_heads=4, intermediate_size=12288,
    num_experts=0, num_experts_per_tok=0,
)


@dataclass(frozen=True, slots=True)
class QwenHybridConfig:
    """Everything the model builds from; ``layer_types[i]`` is linear_attention or full_attention."""

    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float
    hidden_act: str
    tie_word_embeddings: bool
    # gated full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attention_bias: bool
    rope_theta: float
    rotary_dim: int
    # gated deltanet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    conv_kernel: int
    # feed-forward
    intermediate_size: int
    moe_layers: frozenset[int]
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    # multi-token prediction
    mtp_num_layers: int

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def conv_dim(self) -> int:
        """Channels of the GDN conv: q ‖ k ‖ v."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.linear_num_value_heads * self.linear_value_head_dim

    def is_moe(self, layer_idx: int) -> bool:
        return layer_idx in self.moe_layers


def _layer_types(cfg: HFConfig, num_layers: int) -> tuple[str, ...]:
    types = getattr(cfg, "layer_types", None)
    if types is None:
        interval = getattr(cfg, "full_attention_interval", 4)
        types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers)]
    if len(types) != num_layers or set(types) - {LINEAR_ATTENTION, FULL_ATTENTION}:
        raise ValueError(f"layer_types {types!r} must name {num_layers} layers, each linear_attention or full_attention")
    return tuple(types)


def _rope(cfg: HFConfig, head_dim: int) -> tuple[float, int]:
    """(theta, rotary_dim) from ``rope_parameters`` (transformers 5) or the older top-level fields."""
    params = getattr(cfg, "rope_parameters", None)
    params = params.to_dict() if isinstance(params, HFConfig) else dict(params or {})
    scaling = getattr(cfg, "rope_scaling", None)
    scaling = scaling.to_dict() if isinstance(scaling, HFConfig) else dict(scaling or {})
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise ValueError(f"rope_type {rope_type!r} is not supported by the Qwen GDN models (only 'default')")
    theta = params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    factor = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 0.25))
    return float(theta), int(head_dim * factor)


def parse_config(hf_config: HFConfig, text: HFConfig, defaults: dict[str, Any], dense_rule: str) -> QwenHybridConfig:
    """Read ``text`` (the text sub-config); ``hf_config`` is the top level (it owns tied embeddings).

    ``dense_rule``: "qwen3_next" (``mlp_only_layers`` / ``decoder_sparse_step`` pick dense layers),
    "all_moe" or "all_dense".
    """
    def get(name: str, default: Any = None) -> Any:
        return getattr(text, name, defaults.get(name, default))

    num_layers = get("num_hidden_layers")
    head_dim = get("head_dim", 256)
    theta, rotary_dim = _rope(text, head_dim)
    num_experts = get("num_experts")
    if dense_rule == "all_dense":
        moe_layers: frozenset[int] = frozenset()
    elif dense_rule == "all_moe":
        moe_layers = frozenset(range(num_layers))
    else:
        only_mlp = set(get("mlp_only_layers", None) or [])
        step = get("decoder_sparse_step", 1)
        moe_layers = frozenset(
            i for i in range(num_layers) if i not in only_mlp and num_experts > 0 and (i + 1) % step == 0
        )
    return QwenHybridConfig(
        vocab_size=get("vocab_size"),
        hidden_size=get("hidden_size"),
        layer_types=_layer_types(text, num_layers),
        rms_norm_eps=get("rms_norm_eps", 1e-6),
        hidden_act=get("hidden_act", "silu"),
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        num_attention_heads=get("num_attention_heads", 16),
        num_key_value_heads=get("num_key_value_heads"),
        head_dim=head_dim,
        attention_bias=get("attention_bias", False),
        rope_theta=theta,
        rotary_dim=rotary_dim,
        linear_num_key_heads=get("linear_num_key_heads", 16),
        linear_num_value_heads=get("linear_num_value_heads", 32),
        linear_key_head_dim=get("linear_key_head_dim", 128),
        linear_value_head_dim=get("linear_value_head_dim", 128),
        conv_kernel=get("linear_conv_kernel_dim", 4),
        intermediate_size=get("intermediate_size"),
        moe_layers=moe_layers,
        num_experts=num_experts,
        num_experts_per_tok=get("num_experts_per_tok"),
        moe_intermediate_size=get("moe_intermediate_size", 512),
        shared_expert_intermediate_size=get("shared_expert_intermediate_size", 512),
        # Qwen3.5 MoE's router always renormalises; Qwen3-Next's follows norm_topk_prob
        norm_topk_prob=True if dense_rule == "all_moe" else get("norm_topk_prob", True),
        mtp_num_layers=get("mtp_num_hidden_layers", None) or get("num_nextn_predict_layers", 0) or 0,
    )
