"""GGUF llama tensors -> Hugging Face ``LlamaForCausalLM`` tensors: names, dequantization, Q/K row order.

llama.cpp's converter reorders the rows of ``attn_q`` / ``attn_k`` (and their biases) inside each
head so that rotary pairs are adjacent (``x0 x1 | x2 x3 ...``, GPT-J style); Hugging Face checkpoints
keep rotate-half order (``x0 x2 ... | x1 x3 ...``). ``unpermute_rotary_rows`` puts them back.
"""
from __future__ import annotations

import re

import numpy as np
import torch
from gguf import quants
from gguf.constants import GGMLQuantizationType as T

from armillary_llama.gguf_dequant import dequantize_fast
from armillary_llama.gguf_file import GGUFError, GGUFFile, TensorInfo

# Types we dequantize (the common ones vectorised here, K-quants through the gguf package) and test;
# others fail at open with a clear error.
SUPPORTED_TYPES = frozenset({
    T.F32, T.F16, T.BF16,
    T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
    T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
})

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")
# Folded into the config (rope_freqs) or recomputed at run time (attn_rot_embd): never yielded as weights.
CONFIG_TENSORS = ("rope_freqs.weight",)
_IGNORED = re.compile(r"blk\.\d+\.attn_rot_embd")
# Names a mixture-of-experts llama (Mixtral) uses; this plugin serves dense llama only.
_MOE_PARTS = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, None for tensors that are not weights; raises on unknown ones."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if gguf_name in CONFIG_TENSORS or _IGNORED.fullmatch(gguf_name):
        return None
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    if match and match.group(2) in _MOE_PARTS:
        raise GGUFError(f"tensor {gguf_name!r} belongs to a mixture-of-experts llama (Mixtral-style), "
                        "which armillary-llama does not serve")
    raise GGUFError(f"tensor {gguf_name!r} is not part of a llama model; armillary-llama does not know it")


def check_supported(info: TensorInfo, path: str) -> None:
    """Raise naming the tensor and its type when we cannot dequantize it."""
    if info.ggml_type not in SUPPORTED_TYPES:
        supported = ", ".join(t.name for t in sorted(SUPPORTED_TYPES))
        raise GGUFError(f"GGUF file {path!r}: {info.describe()} uses quantization type {info.type_name}, which "
                        f"armillary-llama does not dequantize (supported: {supported})")


def dequantize(gguf: GGUFFile, info: TensorInfo) -> torch.Tensor:
    """The tensor as float32 in torch order: ``info.shape``. Copies out of the memory map."""
    qtype = T(info.ggml_type)
    raw = gguf.raw(info)
    rows = int(np.prod(info.shape[:-1], dtype=np.int64))
    if qtype == T.F32:
        values = raw.view(np.float32).copy()
    else:
        values = dequantize_fast(raw.reshape(-1), qtype)
        if values is None:
            values = quants.dequantize(raw.reshape(rows, -1), qtype)  # [rows, row values] float32
    if values.size != int(np.prod(info.shape, dtype=np.int64)):
        raise GGUFError(f"GGUF file {str(gguf.path)!r}: {info.describe()} dequantized to {values.size} values")
    return torch.from_numpy(values.reshape(info.shape))


def unpermute_rotary_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head pair interleaving of Q/K rows. w: [num_heads * head_dim, ...] (or a bias)."""
    head_dim = w.shape[0] // num_heads
    # llama.cpp order within a head is [head_dim/2 pairs, 2]; HF order is [2 halves, head_dim/2]
    return w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
