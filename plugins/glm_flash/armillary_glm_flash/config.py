"""The ``glm4_moe_lite`` config.json fields the model reads, checked once (transformers' defaults where omitted)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from armillary.hf_config import HFConfig

DENSE, SPARSE = "dense", "sparse"

# transformers' Glm4MoeLiteConfig defaults (GLM-4.7-Flash), used only where config.json omits a field
DEFAULTS: dict[str, Any] = dict(
    vocab_size=154880, hidden_size=2048, intermediate_size=10240, moe_intermediate_size=1536, num_hidden_layers=47,
    num_attention_heads=20, n_shared_experts=1, n_routed_experts=64, routed_scaling_factor=1.8, kv_lora_rank=512,
    q_lora_rank=768, qk_rope_head_dim=64, v_head_dim=256, qk_nope_head_dim=192, n_group=1, topk_group=1,
    num_experts_per_tok=4, norm_topk_prob=True, hidden_act="silu", max_position_embeddings=202752,
    rms_norm_eps=1e-5, tie_word_embeddings=False, rope_interleave=True, attention_bias=False,
    num_nextn_predict_layers=0,
)


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """RoPE of the rotary dims: ``type`` default or yarn, and yarn's parameters."""

    theta: float
    type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True, slots=True)
class GlmFlashConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    mlp_layer_types: tuple[str, ...]
    rms_norm_eps: float
    hidden_act: str
    tie_word_embeddings: bool
    # MLA
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    attention_bias: bool
    rope_interleave: bool
    rope: RopeSpec
    # MLPs
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    n_group: int
    topk_group: int
    num_nextn_predict_layers: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """``qk_head_dim ** -0.5``, times yarn's ``mscale(factor, mscale_all_dim) ** 2`` when set (transformers'
        ``yarn_apply_mscale``)."""
        scale = self.qk_head_dim ** -0.5
        if self.rope.type != "default" and self.rope.mscale_all_dim:
            m = yarn_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale *= m * m
        return scale

    def is_moe(self, layer: int) -> bool:
        return self.mlp_layer_types[layer] == SPARSE

    @classmethod
    def from_hf(cls, hf: HFConfig) -> GlmFlashConfig:
        def get(name: str) -> Any:
            value = getattr(hf, name, None)
            return DEFAULTS[name] if value is None else value

        layers = int(get("num_hidden_layers"))
        types = getattr(hf, "mlp_layer_types", None)
        if types is None:
            first_dense = getattr(hf, "first_k_dense_replace", None)  # DeepSeek-style configs
            types = [DENSE] * (1 if first_dense is None else first_dense)
            types += [SPARSE] * (layers - len(types))
        types = tuple(types)
        if len(types) != layers or any(t not in (DENSE, SPARSE) for t in types):
            raise ValueError(f"mlp_layer_types must be {layers} entries of 'dense' / 'sparse', got {list(types)}")
        cfg = cls(
            vocab_size=int(get("vocab_size")), hidden_size=int(get("hidden_size")), num_hidden_layers=layers,
            mlp_layer_types=types, rms_norm_eps=float(get("rms_norm_eps")), hidden_act=str(get("hidden_act")),
            tie_word_embeddings=bool(get("tie_word_embeddings")),
            num_attention_heads=int(get("num_attention_heads")),
            q_lora_rank=getattr(hf, "q_lora_rank", DEFAULTS["q_lora_rank"]),  # null: one full-rank q_proj
            kv_lora_rank=int(get("kv_lora_rank")), qk_nope_head_dim=int(get("qk_nope_head_dim")),
            qk_rope_head_dim=int(get("qk_rope_head_dim")), v_head_dim=int(get("v_head_dim")),
            attention_bias=bool(get("attention_bias")), rope_interleave=bool(get("rope_interleave")),
            rope=read_rope(hf), intermediate_size=int(get("intermediate_size")),
            moe_intermediate_size=int(get("moe_intermediate_size")), n_routed_experts=int(get("n_routed_experts")),
            n_shared_experts=int(get("n_shared_experts") or 0), num_experts_per_tok=int(get("num_experts_per_tok")),
            norm_topk_prob=bool(get("norm_topk_prob")), routed_scaling_factor=float(get("routed_scaling_factor")),
            n_group=int(get("n_group")), topk_group=int(get("topk_group")),
            num_nextn_predict_layers=int(get("num_nextn_predict_layers") or 0),
        )
        if cfg.n_routed_experts % cfg.n_group:
            raise ValueError(f"n_routed_experts {cfg.n_routed_experts} is not a multiple of n_group {cfg.n_group}")
        if getattr(hf, "num_key_value_heads", cfg.num_attention_heads) not in (None, cfg.num_attention_heads):
            raise ValueError("glm4_moe_lite MLA expands the latent to every head: num_key_value_heads must equal "
                             f"num_attention_heads ({cfg.num_attention_heads}), got {hf.num_key_value_heads}")
        return cfg


def read_rope(hf: HFConfig) -> RopeSpec:
    """``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling`` (earlier configs)."""
    params = getattr(hf, "rope_parameters", None)
    params = params.to_dict() if isinstance(params, HFConfig) else dict(params or {})
    scaling = getattr(hf, "rope_scaling", None)
    if isinstance(scaling, HFConfig):
        params = {**scaling.to_dict(), **params}
    theta = params.get("rope_theta", getattr(hf, "rope_theta", None) or 10000.0)
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "default":
        return RopeSpec(float(theta))
    if kind != "yarn":
        raise ValueError(f"glm4_moe_lite: rope type {kind!r} is not served (default and yarn are)")
    factor = params.get("factor")
    original = params.get("original_max_position_embeddings")
    if original is None:
        raise ValueError("yarn rope_parameters need original_max_position_embeddings")
    if factor is None:  # DeepSeek-V3 style: the ratio of the context lengths
        factor = getattr(hf, "max_position_embeddings", DEFAULTS["max_position_embeddings"]) / original
    return RopeSpec(float(theta), "yarn", float(factor), int(original), float(params.get("beta_fast") or 32),
                    float(params.get("beta_slow") or 1), params.get("mscale"), params.get("mscale_all_dim"),
                    params.get("attention_factor"), bool(params.get("truncate", True)))


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
