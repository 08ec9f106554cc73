"""``LlamaForCausalLM`` and ``MistralForCausalLM``: packed ``ForwardBatch`` in, final-normed hidden states out.

Mistral is llama with ``sliding_window``: its windowed layers keep ``SlidingWindow`` caches and attend
to the last ``window`` positions. Parameter names follow Hugging Face's (``model.layers.N.self_attn...``)
except the two fused projections, so ``load_weights`` maps a safetensors checkpoint and a dequantized
GGUF alike.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn
from torch.nn.utils import skip_init

from armillary.cache_spec import FullAttention, LayerCacheSpec, SlidingWindow
from armillary.errors import WeightLoadError
from armillary.forward_batch import ForwardBatch
from armillary.hf_config import HFConfig
from armillary.kernels import ops
from armillary.kernels.rotary import rotary_cos_sin
from armillary.model_base import CausalLM
from armillary_llama.config import LlamaArgs, config_warnings
from armillary_llama.layers import LlamaDecoderLayer, RMSNorm, linear
from armillary_llama.rope import llama_inv_freq

log = logging.getLogger(__name__)

# checkpoint projection -> (fused parameter, shard index)
_FUSED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
# present in some checkpoints, recomputed here
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)


class LlamaModel(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.embed_tokens = skip_init(nn.Embedding, args.vocab_size, args.hidden_size,
                                      device=torch.get_default_device())
        self.layers = nn.ModuleList(LlamaDecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class LlamaForCausalLM(CausalLM):
    """Built as ``cls(hf_config)`` under ``torch.device(device)`` and the model's default dtype."""

    hf_architecture = "LlamaForCausalLM"

    def __init__(self, hf_config: HFConfig) -> None:
        super().__init__()
        self.args = LlamaArgs.from_hf(hf_config)
        for line in config_warnings(hf_config, self.hf_architecture):
            log.warning("%s", line)
        self.model = LlamaModel(self.args)
        self.lm_head = None if self.args.tie_word_embeddings else linear(self.args.hidden_size, self.args.vocab_size, False)
        self.register_buffer("inv_freq", llama_inv_freq(self.args.rope, self.args.head_dim), persistent=False)
        self.requires_grad_(False)

    @classmethod
    def cache_layout(cls, hf_config: HFConfig) -> list[LayerCacheSpec | None]:
        args = LlamaArgs.from_hf(hf_config)
        return [FullAttention(args.num_kv_heads, args.head_dim) if window is None
                else SlidingWindow(args.num_kv_heads, args.head_dim, window=window)
                for window in args.sliding_windows]

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.model.embed_tokens(batch.input_ids)  # [T, H]
        cos, sin = rotary_cos_sin(batch.positions, self.inv_freq)  # [T, head_dim // 2] each
        residual = None
        for layer, cache in zip(self.model.layers, batch.caches):
            x, residual = layer(x, residual, batch, cache, cos, sin)
        return self.model.norm.add(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return ops.linear(hidden, weight).float()

    def _shard_rows(self, fused: str, shard: int) -> tuple[int, int]:
        """(first row, row count) of one checkpoint projection inside a fused parameter."""
        a = self.args
        sizes = [a.q_size, a.kv_size, a.kv_size] if fused == "qkv_proj" else [a.intermediate_size] * 2
        return sum(sizes[:shard]), sizes[shard]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        shards_seen: dict[str, set[int]] = {}
        filled: set[str] = set()
        for name, tensor in weights:
            if name.endswith(_SKIPPED_SUFFIXES):
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                log.info("tied embeddings: ignoring the checkpoint's lm_head.weight")
                continue
            module, _, kind = name.rpartition(".")
            parent, _, projection = module.rpartition(".")
            if projection in _FUSED:
                fused, shard = _FUSED[projection]
                target = f"{parent}.{fused}.{kind}"
                if target not in params:
                    raise WeightLoadError(f"checkpoint tensor {name!r} matches no parameter of LlamaForCausalLM")
                start, rows = self._shard_rows(fused, shard)
                _copy(name, params[target].data[start:start + rows], tensor)
                shards_seen.setdefault(target, set()).add(shard)
                if len(shards_seen[target]) == (3 if fused == "qkv_proj" else 2):
                    filled.add(target)
                continue
            if name not in params:
                raise WeightLoadError(f"checkpoint tensor {name!r} matches no parameter of LlamaForCausalLM")
            _copy(name, params[name].data, tensor)
            filled.add(name)
        return filled


def _copy(name: str, dest: torch.Tensor, tensor: torch.Tensor) -> None:
    if tuple(dest.shape) != tuple(tensor.shape):
        raise WeightLoadError(f"checkpoint tensor {name!r} has shape {list(tensor.shape)}, the model expects "
                              f"{list(dest.shape)}")
    dest.copy_(tensor)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: llama whose ``sliding_window`` (None = full attention) windows every layer."""

    hf_architecture = "MistralForCausalLM"
