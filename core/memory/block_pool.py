"""The one pool of KV block ids that every paged cache group draws from, with ref counts and a cache of freed prefix blocks."""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable


class BlockPool:
    """Owns block ids ``0..num_blocks-1`` minus the ``reserved`` ones (scratch space for padding).

    A block id names one page in every paged layer tensor of the groups that share a storage
    position (see ``planner``); ref counts let several sequences hold one block (prefix sharing).
    A block whose count drops to zero goes back to ``free_ids``, unless it holds a cached prefix
    (``mark_cached``): then it waits in ``lru`` (oldest first), still hittable, and is evicted
    (``on_evict(block)``) only when ``allocate`` has no never-cached block left. Every usable
    block is in exactly one of: ``free_ids``, ``lru``, in use (count > 0).
    """

    def __init__(self, num_blocks: int, reserved: tuple[int, ...] = ()) -> None:
        self.num_blocks = num_blocks
        self.reserved = reserved
        self.ref_counts = [0] * num_blocks
        self.free_ids: deque[int] = deque(b for b in range(num_blocks) if b not in reserved)
        self.cached_ids: set[int] = set()  # blocks holding a registered prefix (in use or in the LRU)
        self.lru: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody holds, evicted oldest first
        self.on_evict: Callable[[int], None] | None = None  # the prefix cache forgets an evicted block
        self.num_evictions = 0

    @property
    def num_usable(self) -> int:
        return self.num_blocks - len(self.reserved)

    @property
    def num_free(self) -> int:
        """Blocks ``allocate`` can hand out: never-cached ones plus cached ones it may evict."""
        return len(self.free_ids) + len(self.lru)

    @property
    def num_cached_free(self) -> int:
        return len(self.lru)

    @property
    def num_used(self) -> int:
        return self.num_usable - self.num_free

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks (ref count 1), never-cached ones first; the caller checked ``num_free``."""
        if n > self.num_free:
            raise RuntimeError(f"{n} blocks asked for, {self.num_free} free")
        out = []
        for _ in range(n):
            if self.free_ids:
                b = self.free_ids.popleft()
            else:
                b, _ = self.lru.popitem(last=False)
                self.cached_ids.discard(b)
                self.num_evictions += 1
                if self.on_evict is not None:
                    self.on_evict(b)
            self.ref_counts[b] = 1
            out.append(b)
        return out

    def share(self, block: int) -> None:
        """One more holder of a block already in use."""
        if self.ref_counts[block] <= 0:
            raise RuntimeError(f"block {block} is not in use")
        self.ref_counts[block] += 1

    def touch(self, block: int) -> None:
        """One more holder of a cached block, taking it out of the LRU if nobody held it."""
        if self.ref_counts[block] == 0:
            if block not in self.lru:
                raise RuntimeError(f"block {block} is neither in use nor cached")
            del self.lru[block]
        self.ref_counts[block] += 1

    def mark_cached(self, block: int) -> None:
        """``block`` (held) now holds a registered prefix: when released it waits in the LRU."""
        if self.ref_counts[block] <= 0:
            raise RuntimeError(f"block {block} is not in use")
        self.cached_ids.add(block)

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each of ``blocks`` (latest first, so they are reused / evicted first)."""
        for b in reversed(blocks):
            if b in self.reserved:
                continue  # a table entry that points at scratch space holds nothing
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                if b in self.cached_ids:
                    self.lru[b] = None
                else:
                    self.free_ids.append(b)
            elif self.ref_counts[b] < 0:
                raise RuntimeError(f"block {b} released more often than held")
