"""Which slice of a model this process builds and runs: rank, tensor- and expert-parallel sizes.

A worker builds its model inside ``use_parallel(ctx)``; shared layers read ``get_parallel()`` to
size their shards (column-parallel output rows, row-parallel input columns, the experts an EP
rank owns). Everything is size 1 until tensor / expert parallelism adds workers.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ParallelContext:
    """``rank`` of ``world_size`` processes; TP groups of ``tp_size``, EP groups of ``ep_size``."""

    rank: int = 0
    world_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1

    def __post_init__(self) -> None:
        for name, rank, size in (("", self.rank, self.world_size), ("tp_", self.tp_rank, self.tp_size),
                                 ("ep_", self.ep_rank, self.ep_size)):
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"{name}rank {rank} is outside {name}size {size}")

    @property
    def is_driver(self) -> bool:
        """The rank that samples and hands tokens back to the engine."""
        return self.rank == 0

    def shard(self, size: int, what: str = "dimension") -> tuple[int, int]:
        """(start, length) of this TP rank's equal slice of ``size``; raises when it does not divide."""
        if size % self.tp_size:
            raise ValueError(f"{what} of {size} does not split over tensor-parallel size {self.tp_size}")
        n = size // self.tp_size
        return self.tp_rank * n, n

    def kv_heads(self, total: int) -> int:
        """Key-value heads this rank holds of ``total``: an equal share, or one (replicated) when fewer than ranks."""
        return max(1, total // self.tp_size)


SINGLE = ParallelContext()
_current: ParallelContext = SINGLE


def get_parallel() -> ParallelContext:
    """The context of the model being built (size 1 outside any ``use_parallel``)."""
    return _current


@contextmanager
def use_parallel(ctx: ParallelContext) -> Iterator[ParallelContext]:
    """Build a model for ``ctx``: layers constructed inside read it through ``get_parallel()``."""
    global _current
    old, _current = _current, ctx
    try:
        yield ctx
    finally:
        _current = old
