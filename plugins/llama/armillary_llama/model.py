"""``LlamaForCausalLM`` and ``MistralForCausalLM``: packed ``ForwardBatch`` in, final-normed hidden states out.

Mistral is llama with ``sliding_window``: its windowed layers keep ``SlidingWindow`` caches and attend
to the last ``window`` positions. Parameter names follow Hugging Face's (``model.layers.N.self_attn...``)
except the two stacked projections, which core's ``CheckpointLoader`` fills through the layers'
``checkpoint_pieces``, so ``load_weights`` maps a safetensors checkpoint and a dequantized GGUF alike.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from armillary.cache_spec import FullAttention, LayerCacheSpec, SlidingWindow
from armillary.errors import WeightLoadError
from armillary.forward_batch import ForwardBatch
from armillary.hf_config import HFConfig
from armillary.kernels import ops
from armillary.kernels.rotary import rotary_cos_sin
from armillary.model_base import CausalLM
from armillary.parallel import get_parallel
from armillary.layers import CheckpointLoader, ReplicatedLinear, RMSNorm, VocabEmbedding
from armillary_llama.config import LlamaArgs, config_warnings
from armillary_llama.layers import LlamaDecoderLayer
from armillary_llama.rope import llama_inv_freq

log = logging.getLogger(__name__)

# present in some checkpoints, recomputed here
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)


class LlamaModel(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class LlamaForCausalLM(CausalLM):
    """Built as ``cls(hf_config)`` under ``torch.device(device)`` and the model's default dtype."""

    hf_architecture = "LlamaForCausalLM"
    supports_tensor_parallel = True  # heads, MLP rows / columns, the embedding's vocabulary rows split

    def __init__(self, hf_config: HFConfig) -> None:
        super().__init__()
        self.args = LlamaArgs.from_hf(hf_config)
        for line in config_warnings(hf_config, self.hf_architecture):
            log.warning("%s", line)
        self.model = LlamaModel(self.args)
        self.lm_head = None if self.args.tie_word_embeddings else ReplicatedLinear(self.args.hidden_size,
                                                                                   self.args.vocab_size, prefix="lm_head")
        self.register_buffer("inv_freq", llama_inv_freq(self.args.rope, self.args.head_dim), persistent=False)
        self.requires_grad_(False)

    @classmethod
    def cache_layout(cls, hf_config: HFConfig) -> list[LayerCacheSpec | None]:
        args = LlamaArgs.from_hf(hf_config)
        kv_heads = get_parallel().kv_heads(args.num_kv_heads)  # this rank's share (inside use_parallel)
        return [FullAttention(kv_heads, args.head_dim) if window is None
                else SlidingWindow(kv_heads, args.head_dim, window=window)
                for window in args.sliding_windows]

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.model.embed_tokens(batch.input_ids)  # [T, H]
        cos, sin = rotary_cos_sin(batch.positions, self.inv_freq)  # [T, head_dim // 2] each
        residual = None
        for layer, cache in zip(self.model.layers, batch.caches):
            x, residual = layer(x, residual, batch, cache, cos, sin)
        return self.model.norm.add(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:  # tied: the embedding matrix (this rank's vocabulary rows) is the head
            embed = self.model.embed_tokens
            return embed.gather_logits(ops.linear(hidden, embed.weight).float())
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loader = CheckpointLoader(self)
        unknown = []
        for name, tensor in weights:
            if name.endswith(_SKIPPED_SUFFIXES):
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                log.info("tied embeddings: ignoring the checkpoint's lm_head.weight")
                continue
            if loader.load(name, tensor) is None:
                unknown.append(name)
        if unknown:
            one = len(unknown) == 1
            raise WeightLoadError(f"checkpoint tensor{'' if one else 's'} {', '.join(map(repr, sorted(unknown)[:20]))} "
                                  f"match{'es' if one else ''} no parameter of {type(self).__name__}")
        return loader.loaded()


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: llama whose ``sliding_window`` (None = full attention) windows every layer."""

    hf_architecture = "MistralForCausalLM"
