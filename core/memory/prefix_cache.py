"""The prefix cache's index: computed blocks and recurrent-state snapshots by hash-chain key, and the deepest hit.

Paged groups register a block once every position in it is computed (full blocks while a
sequence runs, its partial tail when it ends); a registered block nobody holds waits in the
``BlockPool``'s LRU and is forgotten here when evicted. Hybrid models also need the recurrent
state at the hit position: snapshot rows are registered under the key of the block ending
there and kept in their own LRU (the budget of snapshot rows), evicted when a new snapshot
needs a row. The index is host bookkeeping only; ``CacheCoordinator`` applies a hit.
"""
from __future__ import annotations

from bisect import bisect_left
from collections import OrderedDict
from dataclasses import dataclass

from armillary.memory.block_pool import BlockPool
from armillary.memory.groups import CacheGroup
from armillary.memory.prefix_hash import ROOT, HashChain, block_key


@dataclass(slots=True)
class CachedEntry:
    """What a key stands for (checked on every hit, so a hash collision is a miss) and where it is."""

    parent: int
    tokens: tuple[int, ...]
    value: int  # a block id (paged groups) or a snapshot row


@dataclass(slots=True)
class PrefixHit:
    """Resume at position ``num_tokens``: the cached blocks below it and the state there.

    ``tables[g][i]``: the cached block of table index ``i < num_tokens // block_size`` in paged
    group ``g``, or None where the group does not read it (outside a sliding window).
    ``partial[g]``: the cached partial block holding positions ``[num_tokens // bs * bs,
    num_tokens)`` (when ``num_tokens`` is mid-block), copied into a fresh block before use.
    """

    num_tokens: int
    tables: list[list[int | None]]
    partial: list[int]
    snapshot: int | None = None


class PrefixIndex:
    def __init__(self, pool: BlockPool, num_groups: int, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.blocks: list[dict[int, CachedEntry]] = [{} for _ in range(num_groups)]
        self.block_keys: dict[int, tuple[int, int]] = {}  # block id -> (group, key)
        self.tails: dict[int, dict[int, int]] = {}  # parent key -> {partial tail length: entries cached}
        self.snapshots: dict[int, CachedEntry] = {}  # key -> the row holding the state there
        self.snapshot_keys: dict[int, int] = {}  # row -> key
        self.snapshot_lru: OrderedDict[int, None] = OrderedDict()  # evictable rows, oldest first
        pool.on_evict = self.forget_block

    # ---- blocks

    def register_block(self, group: int, parent: int, tokens: tuple[int, ...], key: int, block: int) -> None:
        """``block`` (held by the caller) holds ``tokens`` after ``parent``; a key already cached keeps its block."""
        if key in self.blocks[group] or block in self.block_keys:
            return
        self.blocks[group][key] = CachedEntry(parent, tokens, block)
        self.block_keys[block] = (group, key)
        self._count_tail(parent, tokens, 1)
        self.pool.mark_cached(block)

    def forget_block(self, block: int) -> None:
        group, key = self.block_keys.pop(block)
        entry = self.blocks[group].pop(key)
        self._count_tail(entry.parent, entry.tokens, -1)

    def _count_tail(self, parent: int, tokens: tuple[int, ...], delta: int) -> None:
        m = len(tokens)
        if m < self.block_size:  # a partial tail: lookups hash only the tail lengths cached after a parent
            lengths = self.tails.setdefault(parent, {})
            lengths[m] = lengths.get(m, 0) + delta
            if not lengths[m]:
                del lengths[m]
                if not lengths:
                    del self.tails[parent]

    def block(self, group: int, parent: int, tokens: tuple[int, ...], key: int) -> int | None:
        entry = self.blocks[group].get(key)
        return entry.value if entry is not None and entry.parent == parent and entry.tokens == tokens else None

    # ---- snapshots

    def register_snapshot(self, parent: int, tokens: tuple[int, ...], key: int, row: int, evictable: bool) -> bool:
        """Cache ``row`` as the state after the block ``key``; False (row not taken) if one is cached there."""
        if key in self.snapshots:
            return False
        self.snapshots[key] = CachedEntry(parent, tokens, row)
        self._count_tail(parent, tokens, 1)
        self.snapshot_keys[row] = key
        if evictable:
            self.snapshot_lru[row] = None
        return True

    def snapshot(self, parent: int, tokens: tuple[int, ...], key: int) -> int | None:
        entry = self.snapshots.get(key)
        return entry.value if entry is not None and entry.parent == parent and entry.tokens == tokens else None

    def pin_snapshot(self, row: int) -> None:
        """Keep ``row`` from eviction (a restore from it is not yet in a plan)."""
        self.snapshot_lru.pop(row, None)

    def unpin_snapshot(self, row: int) -> None:
        if row in self.snapshot_keys:
            self.snapshot_lru[row] = None  # most recently used

    def evict_snapshot(self) -> int | None:
        """The least recently used evictable row, forgotten here; None if every row is pinned."""
        if not self.snapshot_lru:
            return None
        row, _ = self.snapshot_lru.popitem(last=False)
        entry = self.snapshots.pop(self.snapshot_keys.pop(row))
        self._count_tail(entry.parent, entry.tokens, -1)
        return row

    # ---- lookup

    def find(self, chain: HashChain, token_ids: list[int], limit: int, groups: list[CacheGroup],
             with_state: bool) -> PrefixHit | None:
        """The deepest position ``P <= limit`` whose blocks (each group's ``blocks_for_resume``) are
        all cached, and, ``with_state``, a snapshot too; None when there is none above 0.

        Walks the blocks from the start and stops at the first miss a deeper resume would read (a
        full-attention miss ends it; a miss a sliding window has left behind does not), hashing
        only the blocks it walks: a cold prompt costs O(1) here, a hit O(hit blocks); the rest of
        the chain is hashed as the blocks get computed (``cache_computed``)."""
        bs = self.block_size
        found: list[list[int | None]] = [[] for _ in groups]
        misses: list[list[int]] = [[] for _ in groups]  # ascending indices of the blocks not cached
        bound = limit // bs  # no resume goes past a block some group reads and lacks
        keys, i = chain.keys, 0
        while i < bound:
            if i == len(keys):
                chain.extend(token_ids, (i + 1) * bs)  # just block i
            key, parent, tokens = keys[i], keys[i - 1] if i else ROOT, None
            for g in range(len(groups)):
                entry = self.blocks[g].get(key)
                if entry is not None:
                    tokens = tokens or tuple(token_ids[i * bs:(i + 1) * bs])
                    if entry.parent == parent and entry.tokens == tokens:
                        found[g].append(entry.value)
                        continue
                found[g].append(None)
                misses[g].append(i)
                if i >= groups[g].blocks_for_resume(bound * bs).start:
                    bound = i  # every resume in (i, bound] reads block i (windows only move forward)
            i += 1

        def blocks_cached(pos: int) -> bool:  # every full block a resume at ``pos`` reads
            for g, group in enumerate(groups):
                need = group.blocks_for_resume(pos)
                hi = min(need.stop, pos // bs)
                if need.start < hi and bisect_left(misses[g], hi) - bisect_left(misses[g], need.start):
                    return False
            return True

        deepest = next(k for k in range(bound, -1, -1) if blocks_cached(k * bs))
        best, snapshot = 0, None
        for k in range(deepest, 0, -1):  # block-aligned candidates, deepest first
            row = None
            if with_state:
                if chain.keys[k - 1] not in self.snapshots:
                    continue  # the common case (snapshots sit only at checkpoints and ends): no slicing
                row = self.snapshot(chain.parent(k - 1), tuple(token_ids[(k - 1) * bs:k * bs]), chain.keys[k - 1])
            if (row is not None or not with_state) and blocks_cached(k * bs):
                best, snapshot = k * bs, row
                break
        partial: list[int] = []
        parent = chain.parent(deepest)
        room = min(bs - 1, limit - deepest * bs)
        for m in sorted((m for m in self.tails.get(parent, ()) if m <= room), reverse=True):  # longest first
            if deepest * bs + m <= best:
                break
            tokens = tuple(token_ids[deepest * bs:deepest * bs + m])
            key = block_key(parent, tokens)
            blocks = [self.block(g, parent, tokens, key) for g in range(len(groups))]
            row = self.snapshot(parent, tokens, key) if with_state else None
            if all(b is not None for b in blocks) and (row is not None or not with_state):
                best, snapshot, partial = deepest * bs + m, row, blocks
                break
        end = (deepest + 1) * bs
        if not with_state and deepest * bs < limit < end <= len(token_ids) and limit > best:
            # the whole next block is cached but its last positions must be recomputed: copy it
            tokens = tuple(token_ids[deepest * bs:end])
            key = block_key(parent, tokens)
            blocks = [self.block(g, parent, tokens, key) for g in range(len(groups))]
            if all(b is not None for b in blocks):
                best, partial = limit, blocks
        if best == 0:
            return None
        tables = []
        for g, group in enumerate(groups):
            need, n = group.blocks_for_resume(best), best // bs
            lo, hi = min(need.start, n), min(need.stop, n)
            tables.append([None] * lo + found[g][lo:hi] + [None] * (n - hi))
        return PrefixHit(best, tables, partial, snapshot)
