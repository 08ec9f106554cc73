"""The contract of a cache group: what one group of layers holds per sequence, host side only."""
from __future__ import annotations

from abc import ABC, abstractmethod

from armillary.sequence import Sequence


class CacheGroup(ABC):
    """The layers that keep one kind of per-sequence state, and what each sequence holds of it.

    A group does bookkeeping only: which block ids or state slots a sequence holds. The tensors
    belong to the worker; whatever must happen on the device (zero a new slot, copy a snapshot)
    travels in the ``StepPlan``. The ``CacheCoordinator`` calls every group of a model together,
    so that a sequence gets what it needs in all groups or in none:

    - ``num_needed(seq, num_tokens)``: units (blocks of the shared ``BlockPool``, or state slots)
      ``seq`` still lacks to hold positions ``[0, num_tokens)``; 0 when it holds them.
    - ``allocate(seq, num_tokens)``: take exactly those units. Called only after the coordinator
      saw that every group's need fits, so it cannot fail.
    - ``release_stale(seq)``: return what no later step of ``seq`` will read (blocks fallen out
      of a sliding window once ``seq.num_computed_tokens`` moved on). Default: nothing.
    - ``trim(seq, num_tokens)``: return what lies past position ``num_tokens`` (positions a step
      scheduled but did not accept, e.g. rejected draft tokens).
    - ``free(seq)``: return everything ``seq`` holds here.
    - ``blocks_for_resume(num_cached)`` (paged groups): the table indices whose blocks a sequence
      resuming at position ``num_cached`` (prefix caching) must find cached, i.e. the keys the
      first recomputed query reads; the others may point at scratch space.

    ``uses_blocks`` tells the coordinator which pool the units come from.
    """

    uses_blocks: bool = True

    def __init__(self, group_id: int, layers: tuple[int, ...]) -> None:
        self.group_id = group_id  # paged groups: the index into ``seq.block_tables``
        self.layers = layers  # indices into the model's cache_layout

    @abstractmethod
    def num_needed(self, seq: Sequence, num_tokens: int) -> int: ...

    @abstractmethod
    def allocate(self, seq: Sequence, num_tokens: int) -> None: ...

    def release_stale(self, seq: Sequence) -> None:
        return None

    @abstractmethod
    def trim(self, seq: Sequence, num_tokens: int) -> None: ...

    @abstractmethod
    def free(self, seq: Sequence) -> None: ...

    def blocks_for_resume(self, num_cached: int) -> range:
        return range(0)  # a group without blocks needs none

    def describe(self) -> str:
        return f"{type(self).__name__}(layers {len(self.layers)})"
