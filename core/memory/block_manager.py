"""Paged KV blocks shared by every attention layer, handed out per sequence with ref counts."""
from __future__ import annotations

from collections import deque

from armillary.sequence import Sequence


class BlockManager:
    """Owns block ids ``0..num_blocks-1``; a sequence's ``block_table`` lists its blocks in order.

    Ref counts let one block back several sequences (prefix sharing); a block returns to the
    free list when its count drops to zero.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_ids)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_missing(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks ``seq`` still needs to hold ``num_tokens`` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_hold(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_missing(seq, num_tokens) <= self.num_free

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Extend ``seq.block_table`` to cover ``num_tokens``; the caller checked ``can_hold``."""
        missing = self.num_missing(seq, num_tokens)
        if missing > self.num_free:
            raise RuntimeError(f"{seq} needs {missing} blocks, {self.num_free} free")
        for _ in range(missing):
            block = self.free_ids.popleft()
            self.ref_counts[block] = 1
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_ids.append(block)
        seq.block_table = []
