"""``Gemma3ForCausalLM`` and ``Gemma4ForCausalLM`` (and their ``*ForConditionalGeneration`` checkpoints, text-only).

Sliding layers keep ``SlidingWindow`` caches, global layers ``FullAttention`` ones (Gemma 4: their own
head_dim and kv heads, so the planner packs their smaller pages by bytes); a KV-shared layer keeps
nothing (``None``) and reads its source layer's cache. Embeddings are scaled by ``sqrt(hidden)``
rounded to the model dtype; the LM head is tied unless the config says otherwise; the final logits
are soft-capped (``final_logit_softcapping``) in float32: one launch after the head's GEMV, or inside it
(``ops.gemv``) where the plugin's table turns that on.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from armillary.cache_spec import FullAttention, LayerCacheSpec, SlidingWindow
from armillary.errors import WeightLoadError
from armillary.forward_batch import ForwardBatch
from armillary.hf_config import HFConfig
from armillary.kernels import ops
from armillary.kernels.rotary import rotary_cos_sin
from armillary.layers import CheckpointLoader, ReplicatedLinear, RMSNorm, VocabEmbedding
from armillary.layers.quantization.unquantized import UnquantizedLinearMethod
from armillary.model_base import CausalLM
from armillary.parallel import get_parallel
from armillary_gemma.config import FULL, SLIDING, GemmaArgs, embed_scale
from armillary_gemma.decoder import Gemma3DecoderLayer, Gemma4DecoderLayer
from armillary_gemma.ops import gemv
from armillary_gemma.ops.norm import norm_add_norm
from armillary_gemma.ops.softcap import softcap_logits
from armillary_gemma.rope import gemma_inv_freq
from armillary_gemma.weights import SkipLog, text_name, unused_shared_kv


class GemmaModel(nn.Module):
    def __init__(self, args: GemmaArgs) -> None:
        super().__init__()
        layer_cls = Gemma3DecoderLayer if args.version == 3 else Gemma4DecoderLayer
        self.embed_tokens = VocabEmbedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(layer_cls(args, i, f"model.layers.{i}") for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, args.zero_centered)
        if args.per_layer_dim:  # Gemma 4 E2B / E4B: a small embedding per layer, packed [V, L * P]
            total = args.num_layers * args.per_layer_dim
            self.embed_tokens_per_layer = VocabEmbedding(args.per_layer_vocab, total)
            self.per_layer_model_projection = ReplicatedLinear(args.hidden_size, total,
                                                               prefix="model.per_layer_model_projection")
            self.per_layer_projection_norm = RMSNorm(args.per_layer_dim, args.rms_norm_eps)


class _GemmaForCausalLM(CausalLM):
    """Built as ``cls(hf_config)`` under ``torch.device(device)`` and the model's default dtype."""

    version = 0
    supports_tensor_parallel = True  # heads, MLP / expert widths (or whole experts), vocabulary rows split

    def __init__(self, hf_config: HFConfig) -> None:
        super().__init__()
        self.args = args = GemmaArgs.from_hf(hf_config)
        if args.version != self.version:
            raise ValueError(f"{type(self).__name__} got a Gemma {args.version} config")
        self.model = GemmaModel(args)
        self.lm_head = None if args.tie_word_embeddings else ReplicatedLinear(args.hidden_size, args.vocab_size,
                                                                              prefix="lm_head")
        # the soft-capped GEMV reads a plain weight (the tied embeddings, or an unquantized head)
        self.head_fusable = self.lm_head is None or isinstance(self.lm_head.quant_method, UnquantizedLinearMethod)
        inv = []
        for kind in (SLIDING, FULL):
            head_dim = next((la.head_dim for la in args.layers if la.kind == kind), args.layers[0].head_dim)
            inv.append(gemma_inv_freq(args.rope[kind], head_dim))
        # both layer types' frequencies side by side: one cos / sin pass per step serves both
        self.register_buffer("inv_freq", torch.cat(inv), persistent=False)
        self.rotary_split = inv[0].shape[0]
        self.shared_layers = {i for i, la in enumerate(args.layers) if la.kv_source != i}
        # sqrt(dim) in the model dtype, made once: no host-to-device copy inside a CUDA-graph capture
        self.register_buffer("embed_scale", torch.tensor(embed_scale(args.hidden_size)), persistent=False)
        self.register_buffer("per_layer_embed_scale", torch.tensor(embed_scale(max(args.per_layer_dim, 1))),
                             persistent=False)
        self.requires_grad_(False)

    @classmethod
    def cache_layout(cls, hf_config: HFConfig) -> list[LayerCacheSpec | None]:
        layout: list[LayerCacheSpec | None] = []
        for i, la in enumerate(GemmaArgs.from_hf(hf_config).layers):
            if la.kv_source != i:
                layout.append(None)  # KV-shared: reads layer la.kv_source's cache
            elif la.window is None:
                layout.append(FullAttention(get_parallel().kv_heads(la.num_kv_heads), la.head_dim))
            else:
                layout.append(SlidingWindow(get_parallel().kv_heads(la.num_kv_heads), la.head_dim, window=la.window))
        return layout

    @staticmethod
    def _embed(embedding: VocabEmbedding, ids: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """embedding(ids) · sqrt(dim), the factor rounded to the model dtype first (as Gemma does)."""
        x = embedding(ids)
        return x * scale.to(x.dtype)

    def _rotary(self, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """{layer type: (cos, sin) [T, rot / 2]}: column views of one table (same strides, unit last stride)."""
        cos, sin = rotary_cos_sin(positions, self.inv_freq)  # [T, rot_s / 2 + rot_g / 2] each
        s = self.rotary_split
        return {SLIDING: (cos[:, :s], sin[:, :s]), FULL: (cos[:, s:], sin[:, s:])}

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        embed = self.model.embed_tokens
        weight = embed.weight if self.lm_head is None else self.lm_head.weight
        cap = self.args.final_softcap
        if cap and self.head_fusable and gemv.serves("softcap", hidden, weight):
            logits = gemv.gemma_gemv("softcap", hidden, weight, cap)  # [N, V] float32: the cap in the GEMV
        else:
            logits = softcap_logits(ops.linear(hidden, weight), cap)  # [N, V] float32, the cap one pass after it
        return embed.gather_logits(logits) if self.lm_head is None else logits  # tied: this rank's rows, gathered

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loader, skipped, unknown = CheckpointLoader(self), SkipLog(), []
        for source, tensor in weights:
            name = text_name(source)
            if name is None:
                skipped.skip("vision / audio towers (served text-only)")
                continue
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                skipped.skip("lm_head.weight (tied to the embeddings)")
                continue
            if unused_shared_kv(name, self.shared_layers):
                skipped.skip("key / value weights of KV-shared layers")
                continue
            if loader.load(name, tensor, source=source) is None:
                unknown.append(source)
        skipped.report()
        if unknown:
            one = len(unknown) == 1
            raise WeightLoadError(f"checkpoint tensor{'' if one else 's'} {', '.join(map(repr, sorted(unknown)[:20]))} "
                                  f"match{'es' if one else ''} no parameter of {type(self).__name__}")
        return loader.loaded()


class Gemma3ForCausalLM(_GemmaForCausalLM):
    """Gemma 3 text (1B / 4B / 12B / 27B): 5 sliding : 1 global, (1 + w) norms, GeGLU."""

    version = 3

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self._embed(self.model.embed_tokens, batch.input_ids, self.embed_scale)  # [T, H]
        rotary = self._rotary(batch.positions)
        residual, prev_norm = None, None
        for layer, la, cache in zip(self.model.layers, self.args.layers, batch.caches):
            x, residual = layer(x, residual, prev_norm, batch, cache, *rotary[la.kind])
            prev_norm = layer.post_feedforward_layernorm.weight
        norm = self.model.norm
        return norm_add_norm(x, residual, prev_norm, norm.weight, norm.eps, norm.zero_centered)[0]


class Gemma4ForCausalLM(_GemmaForCausalLM):
    """Gemma 4 text (31B dense, 26B-A4B MoE, E2B / E4B with per-layer inputs and KV-shared layers)."""

    version = 4

    def _per_layer_inputs(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[T, L, P]: (norm(proj(x) · H^-½) + embed_per_layer(ids)) · 2^-½, x the scaled embeddings."""
        m, n, p = self.model, x.shape[0], self.args.per_layer_dim
        token = self._embed(m.embed_tokens_per_layer, ids, self.per_layer_embed_scale).view(n, -1, p)
        context = (m.per_layer_model_projection(x) * self.args.hidden_size**-0.5).view(n, -1, p)
        return (m.per_layer_projection_norm(context) + token) * 2.0**-0.5

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self._embed(self.model.embed_tokens, batch.input_ids, self.embed_scale)  # [T, H]
        rotary = self._rotary(batch.positions)
        per_layer = self._per_layer_inputs(batch.input_ids, x) if self.args.per_layer_dim else None
        layers = self.model.layers
        h = layers[0].input_layernorm(x)
        for i, (layer, la) in enumerate(zip(layers, self.args.layers)):
            # each layer's tail norms the stream for the next layer (the final norm after the last one)
            nxt = layers[i + 1].input_layernorm.weight if i + 1 < len(layers) else self.model.norm.weight
            x, h = layer(x, h, batch, batch.caches[la.kv_source], *rotary[la.kind],
                         per_layer[:, i] if per_layer is not None else None, nxt)
        return h
