"""Cache groups: the layers of a model that keep the same kind of per-sequence state."""
from __future__ import annotations

from armillary.memory.groups.base import CacheGroup
from armillary.memory.groups.paged import FullAttentionGroup, SlidingWindowGroup
from armillary.memory.groups.recurrent import RecurrentGroup

__all__ = ["CacheGroup", "FullAttentionGroup", "SlidingWindowGroup", "RecurrentGroup"]
