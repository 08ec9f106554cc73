"""What each layer keeps between steps; the memory planner sizes the pools from this alone.

A model's ``cache_layout(hf_config)`` returns one entry per layer (``None`` for a layer that
keeps nothing). Layer index ``i`` of the layout is the index into ``ForwardBatch.caches``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class FullAttention:
    """Paged K and V: ``[num_blocks, block_size, kv_heads, head_dim]`` each.

    ``kv_dtype`` None stores the model dtype; a narrower one (FP8) adds per-layer ``k_scale`` /
    ``v_scale`` tensors to the layer's ``KVCache`` when ``scaled``.
    """

    kv_heads: int
    head_dim: int
    v_head_dim: int | None = None  # defaults to head_dim
    kv_dtype: torch.dtype | None = None
    scaled: bool = False

    def cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return self.kv_dtype or model_dtype

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return self.kv_heads * (self.head_dim + (self.v_head_dim or self.head_dim)) * _size(self.cache_dtype(dtype))


@dataclass(frozen=True, slots=True)
class SlidingWindow(FullAttention):
    """Like ``FullAttention`` but a token only reads the ``window`` latest keys (itself included),
    so its cache group returns blocks that fall wholly out of the window."""

    window: int = 0


@dataclass(frozen=True, slots=True)
class LatentAttention:
    """MLA: one latent of ``kv_lora_rank + rope_dim`` values per token, ``[num_blocks, block_size, D]``."""

    kv_lora_rank: int
    rope_dim: int
    kv_dtype: torch.dtype | None = None

    def cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return self.kv_dtype or model_dtype

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return (self.kv_lora_rank + self.rope_dim) * _size(self.cache_dtype(dtype))


@dataclass(frozen=True, slots=True)
class Recurrent:
    """Fixed-size per-sequence state (GDN, Mamba-2): one ``[num_slots, *shape]`` tensor per entry.

    ``dtypes[i] = None`` means the model dtype; recurrent SSM states are usually ``torch.float32``.
    """

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype | None, ...]

    def bytes_per_slot(self, model_dtype: torch.dtype) -> int:
        total = 0
        for shape, dt in zip(self.shapes, self.dtypes):
            n = 1
            for s in shape:
                n *= s
            total += n * _size(dt or model_dtype)
        return total


LayerCacheSpec = FullAttention | SlidingWindow | LatentAttention | Recurrent


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
