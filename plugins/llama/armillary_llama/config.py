"""The llama ``config.json`` fields the model reads, checked once."""
from __future__ import annotations

from dataclasses import dataclass

from armillary.hf_config import HFConfig
from armillary_llama.rope import RopeArgs, rope_args


@dataclass(frozen=True, slots=True)
class LlamaArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str
    attention_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    rope: RopeArgs

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, hf_config: HFConfig) -> LlamaArgs:
        heads = hf_config.num_attention_heads
        kv_heads = hf_config.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        return cls(
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=hf_config.get("head_dim") or hf_config.hidden_size // heads,
            rms_norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
            hidden_act=hf_config.get("hidden_act", "silu"),
            attention_bias=bool(hf_config.get("attention_bias", False)),
            mlp_bias=bool(hf_config.get("mlp_bias", False)),
            tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
            rope=rope_args(hf_config),
        )
