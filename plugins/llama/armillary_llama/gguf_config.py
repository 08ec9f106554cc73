"""A llama GGUF's metadata -> a Hugging Face ``LlamaConfig``-shaped dict, and generation defaults.

Keys are llama.cpp's (``{arch}.block_count``, ``{arch}.attention.head_count`` ...); the output uses
``config.json`` names, with RoPE in transformers' current ``rope_parameters`` form. Llama 3.1-style
RoPE scaling reaches a GGUF as a ``rope_freqs.weight`` tensor of per-frequency divisors rather than
as metadata; we carry it as ``rope_type: "freq_factors"`` (see ``armillary_llama.rope``).
"""
from __future__ import annotations

from typing import Any

from gguf.constants import GGMLQuantizationType as T

from armillary_llama.gguf_file import GGUFError, GGUFFile
from armillary_llama.gguf_tensors import dequantize

# general.architecture values this plugin serves (llama.cpp also writes Mistral and SmolLM as llama)
ARCHITECTURES = ("llama",)

# general.sampling.* (llama.cpp's recommended sampling) -> SamplingParams names
_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
# end-of-generation token ids llama.cpp stops on, besides eos
_EXTRA_EOG_KEYS = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def _required(gguf: GGUFFile, key: str) -> Any:
    if key not in gguf.metadata:
        raise GGUFError(f"GGUF file {str(gguf.path)!r} lacks the metadata key {key!r} a llama model needs")
    return gguf.metadata[key]


def _checkpoint_dtype(gguf: GGUFFile) -> str:
    """float16 / bfloat16 files keep their type; float32 and quantized files load as float32."""
    types = {info.ggml_type for info in gguf.tensors.values() if len(info.shape) == 2}
    if types == {T.F16}:
        return "float16"
    if types == {T.BF16}:
        return "bfloat16"
    return "float32"


def _rope_parameters(gguf: GGUFFile, head_dim: int) -> dict[str, Any]:
    arch = gguf.architecture
    meta = gguf.metadata
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0))}
    rotary_dim = meta.get(f"{arch}.rope.dimension_count", head_dim)
    if rotary_dim != head_dim:
        raise GGUFError(f"GGUF file {str(gguf.path)!r}: rope.dimension_count {rotary_dim} differs from head_dim "
                        f"{head_dim}; partial rotary is not a llama feature and armillary-llama does not serve it")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = meta.get(f"{arch}.rope.scaling.factor", meta.get(f"{arch}.rope.scale_linear"))
    if scaling == "linear" or (scaling == "none" and factor not in (None, 1.0)):
        params.update(rope_type="linear", factor=float(factor))
    elif scaling != "none":
        raise GGUFError(f"GGUF file {str(gguf.path)!r}: RoPE scaling type {scaling!r} is not served by "
                        "armillary-llama (it serves none, linear and llama3-style rope_freqs)")
    if "rope_freqs.weight" in gguf.tensors:
        if params["rope_type"] != "default":
            raise GGUFError(f"GGUF file {str(gguf.path)!r} has both rope_freqs.weight and {scaling} RoPE scaling")
        factors = dequantize(gguf, gguf.tensors["rope_freqs.weight"]).tolist()
        if len(factors) != head_dim // 2:
            raise GGUFError(f"GGUF file {str(gguf.path)!r}: rope_freqs.weight has {len(factors)} values, "
                            f"expected head_dim / 2 = {head_dim // 2}")
        params.update(rope_type="freq_factors", freq_factors=factors)
    return params


def llama_config(gguf: GGUFFile) -> dict[str, Any]:
    """``config.json`` of the model in this file; raises ``GGUFError`` for what it cannot express."""
    arch = gguf.architecture
    if arch not in ARCHITECTURES:
        raise GGUFError(f"GGUF file {str(gguf.path)!r} holds a {arch!r} model; armillary-llama serves {list(ARCHITECTURES)}")
    meta = gguf.metadata
    hidden = _required(gguf, f"{arch}.embedding_length")
    heads = _required(gguf, f"{arch}.attention.head_count")
    if "token_embd.weight" not in gguf.tensors:
        raise GGUFError(f"GGUF file {str(gguf.path)!r} has no token_embd.weight tensor")
    head_dim = meta.get(f"{arch}.attention.key_length", hidden // heads)
    if meta.get(f"{arch}.attention.value_length", head_dim) != head_dim:
        raise GGUFError(f"GGUF file {str(gguf.path)!r}: attention.value_length differs from key_length")
    vocab = meta.get(f"{arch}.vocab_size", gguf.tensors["token_embd.weight"].shape[0])
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": _required(gguf, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _required(gguf, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(_required(gguf, f"{arch}.attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": _required(gguf, f"{arch}.context_length"),
        "vocab_size": vocab,
        "hidden_act": "silu",
        "rope_parameters": _rope_parameters(gguf, head_dim),
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "attention_bias": "blk.0.attn_q.bias" in gguf.tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in gguf.tensors,
        "torch_dtype": _checkpoint_dtype(gguf),
    }
    for name, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("pad_token_id", "padding_token_id")):
        if f"tokenizer.ggml.{key}" in meta:
            config[name] = meta[f"tokenizer.ggml.{key}"]
    if meta.get("general.name"):
        config["_name_or_path"] = meta["general.name"]
    return config


def end_of_generation_ids(gguf: GGUFFile) -> list[int]:
    """eos plus llama.cpp's end-of-turn / end-of-message ids, in that order, without repeats."""
    keys = ("tokenizer.ggml.eos_token_id", *_EXTRA_EOG_KEYS)
    return list(dict.fromkeys(int(gguf.metadata[k]) for k in keys if k in gguf.metadata))


def generation_defaults(gguf: GGUFFile) -> dict[str, Any]:
    """``generation_config.json``-style defaults: end-of-generation ids and any recommended sampling."""
    defaults: dict[str, Any] = {key: gguf.metadata[gguf_key] for gguf_key, key in _SAMPLING_KEYS.items()
                                if gguf_key in gguf.metadata}
    eos = end_of_generation_ids(gguf)
    if eos:
        defaults["eos_token_id"] = eos
    return defaults
