"""The llama ``config.json`` fields the model reads, checked once.

Sliding-window attention: ``sliding_window`` (an int; None / absent / 0 = full attention) windows
every layer, or only the ``"sliding_attention"`` entries of ``layer_types`` when the config lists
them; ``use_sliding_window: false`` turns it off. That is vLLM's reading for Mistral and for a llama
config alike (its model-level window applies to every attention layer). transformers'
``LlamaForCausalLM`` ignores the field, so for that architecture ``config_warnings`` says so.
"""
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
    sliding_windows: tuple[int | None, ...]  # per layer: the window in tokens, None = full attention

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
            sliding_windows=sliding_windows(hf_config),
        )


def sliding_windows(hf_config: HFConfig) -> tuple[int | None, ...]:
    """Per layer, the attention window the config asks for (None: full attention)."""
    num_layers = hf_config.num_hidden_layers
    window = hf_config.get("sliding_window")
    if hf_config.get("use_sliding_window") is False or window in (None, 0):
        return (None,) * num_layers
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"sliding_window must be a positive int or null, not {window!r}")
    layer_types = hf_config.get("layer_types")
    if layer_types is None:
        return (window,) * num_layers
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types lists {len(layer_types)} layers, the model has {num_layers}")
    unknown = set(layer_types) - {"full_attention", "sliding_attention"}
    if unknown:
        raise ValueError(f"layer_types {sorted(unknown)} are not served by armillary-llama")
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)


def config_warnings(hf_config: HFConfig, architecture: str) -> list[str]:
    """What a user should hear about how this config is served (one line each)."""
    args = LlamaArgs.from_hf(hf_config)
    windows = sorted({w for w in args.sliding_windows if w})
    if architecture == "LlamaForCausalLM" and windows:
        return [f"config.json sets sliding_window={windows[0]} on a LlamaForCausalLM checkpoint: armillary serves "
                f"it as windowed attention, as vLLM does; transformers' LlamaForCausalLM ignores sliding_window, so "
                f"past {windows[0]} tokens the outputs differ from transformers' (set \"sliding_window\": null in "
                f"config.json for full attention)"]
    return []
