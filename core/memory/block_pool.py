"""The one pool of KV block ids that every paged cache group draws from, with ref counts."""
from __future__ import annotations

from collections import deque


class BlockPool:
    """Owns block ids ``0..num_blocks-1`` minus the ``reserved`` ones (scratch space for padding).

    A block id names one page in every paged layer tensor of the groups that share a storage
    position (see ``planner``); ref counts let several sequences hold one block (prefix sharing),
    which returns to the free list when its count drops to zero.
    """

    def __init__(self, num_blocks: int, reserved: tuple[int, ...] = ()) -> None:
        self.num_blocks = num_blocks
        self.reserved = reserved
        self.ref_counts = [0] * num_blocks
        self.free_ids: deque[int] = deque(b for b in range(num_blocks) if b not in reserved)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - len(self.reserved)

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    @property
    def num_used(self) -> int:
        return self.num_usable - len(self.free_ids)

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks (ref count 1); the caller checked ``num_free``."""
        if n > len(self.free_ids):
            raise RuntimeError(f"{n} blocks asked for, {len(self.free_ids)} free")
        out = [self.free_ids.popleft() for _ in range(n)]
        for b in out:
            self.ref_counts[b] = 1
        return out

    def share(self, block: int) -> None:
        """One more holder of a block already in use."""
        if self.ref_counts[block] <= 0:
            raise RuntimeError(f"block {block} is not in use")
        self.ref_counts[block] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each of ``blocks`` (latest first, so they are reused last)."""
        for b in reversed(blocks):
            if b in self.reserved:
                continue  # a table entry that points at scratch space holds nothing
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_ids.append(b)
            elif self.ref_counts[b] < 0:
                raise RuntimeError(f"block {b} released more often than held")
