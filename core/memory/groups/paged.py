"""Paged groups: full attention and sliding-window attention, each sequence a block table per group."""
from __future__ import annotations

from armillary.memory.block_pool import BlockPool
from armillary.memory.groups.base import CacheGroup
from armillary.sequence import Sequence


class FullAttentionGroup(CacheGroup):
    """Keys (and values, or an MLA latent) of every position: ``ceil(num_tokens / block_size)`` blocks."""

    def __init__(self, group_id: int, layers: tuple[int, ...], pool: BlockPool, block_size: int) -> None:
        super().__init__(group_id, layers)
        self.pool = pool
        self.block_size = block_size

    def table(self, seq: Sequence) -> list[int]:
        return seq.block_tables[self.group_id]

    def num_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(self.table(seq)))

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        self.table(seq).extend(self.pool.allocate(self.num_needed(seq, num_tokens)))

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        table = self.table(seq)
        keep = -(-num_tokens // self.block_size)
        if len(table) > keep:
            self.pool.release(table[keep:])
            del table[keep:]

    def free(self, seq: Sequence) -> None:
        table = self.table(seq)
        self.pool.release(table)
        table.clear()

    def blocks_for_resume(self, num_cached: int) -> range:
        return range(0, -(-num_cached // self.block_size))  # every key before the first recomputed query


class SlidingWindowGroup(FullAttentionGroup):
    """A query at position ``p`` reads keys ``(p - window, p]``: once a block lies wholly before the
    next query's window it returns to the pool, and its table entry points at ``null_block``
    (scratch space the kernels may read but mask), so positions keep their table index."""

    def __init__(self, group_id: int, layers: tuple[int, ...], pool: BlockPool, block_size: int,
                 window: int, null_block: int) -> None:
        super().__init__(group_id, layers, pool, block_size)
        self.window = window
        self.null_block = null_block

    def release_stale(self, seq: Sequence) -> None:
        first_needed = seq.num_computed_tokens - self.window + 1  # oldest key the next query reads
        stale = max(0, first_needed) // self.block_size  # blocks [0, stale) hold only older keys
        table = self.table(seq)
        i = min(stale, len(table)) - 1
        while i >= 0 and table[i] != self.null_block:  # released entries are a prefix: O(newly stale) per step
            self.pool.release([table[i]])
            table[i] = self.null_block
            i -= 1

    def blocks_for_resume(self, num_cached: int) -> range:
        first = max(0, num_cached - self.window + 1)  # oldest key the query at ``num_cached`` reads
        return range(first // self.block_size, -(-num_cached // self.block_size))

    def describe(self) -> str:
        return f"SlidingWindowGroup(layers {len(self.layers)}, window {self.window})"
