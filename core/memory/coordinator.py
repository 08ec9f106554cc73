"""One coordinator hands out and frees what a sequence needs in every cache group, all or nothing."""
from __future__ import annotations

from armillary.memory.block_pool import BlockPool
from armillary.memory.groups import CacheGroup, FullAttentionGroup, RecurrentGroup, SlidingWindowGroup
from armillary.memory.planner import MemoryPlan
from armillary.sequence import Sequence


class CacheCoordinator:
    """The scheduler's single view of cache memory.

    ``paged`` groups draw blocks from the shared ``pool``; the ``recurrent`` group (at most one)
    hands out state slots. ``allocate`` either gives ``seq`` everything it needs in every group or
    changes nothing, so a failed admission or growth never holds memory.
    """

    def __init__(self, pool: BlockPool, paged: list[CacheGroup], recurrent: RecurrentGroup | None,
                 block_size: int) -> None:
        self.pool = pool
        self.paged = paged
        self.recurrent = recurrent
        self.block_size = block_size
        self.groups: list[CacheGroup] = [*paged, *([recurrent] if recurrent is not None else [])]

    @classmethod
    def from_plan(cls, plan: MemoryPlan) -> CacheCoordinator:
        """Groups over one pool, as ``plan`` lays them out; block 0 and the last slot are scratch."""
        scratch = 0
        pool = BlockPool(plan.num_blocks, reserved=(scratch,))
        paged: list[CacheGroup] = []
        for gid, g in enumerate(plan.paged_groups):
            if g.window:
                paged.append(SlidingWindowGroup(gid, g.layers, pool, plan.block_size, g.window, scratch))
            else:
                paged.append(FullAttentionGroup(gid, g.layers, pool, plan.block_size))
        recurrent = None
        if plan.recurrent_layers:
            recurrent = RecurrentGroup(len(paged), plan.recurrent_layers, plan.num_slots, plan.num_slots - 1,
                                       plan.num_snapshots)
        return cls(pool, paged, recurrent, plan.block_size)

    @property
    def num_paged_groups(self) -> int:
        return len(self.paged)

    def new_tables(self) -> list[list[int]]:
        """Empty block tables, one per paged group, for a sequence that holds nothing."""
        return [[] for _ in self.paged]

    def _ensure_tables(self, seq: Sequence) -> None:
        if not seq.block_tables:
            seq.block_tables = self.new_tables()
        elif len(seq.block_tables) != len(self.paged):
            raise RuntimeError(f"{seq} has {len(seq.block_tables)} block tables, the model {len(self.paged)} groups")

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        self._ensure_tables(seq)
        return sum(g.num_needed(seq, num_tokens) for g in self.paged)

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether every group can give ``seq`` what it lacks for ``num_tokens`` positions."""
        if self.blocks_needed(seq, num_tokens) > self.pool.num_free:
            return False
        return self.recurrent is None or self.recurrent.num_needed(seq, num_tokens) <= self.recurrent.num_free

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Hold positions ``[0, num_tokens)`` of ``seq`` in every group; False (nothing taken) if not all fit."""
        if not self.can_allocate(seq, num_tokens):
            return False
        for group in self.groups:
            group.allocate(seq, num_tokens)
        return True

    def release_stale(self, seq: Sequence) -> None:
        for group in self.paged:
            group.release_stale(seq)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        self._ensure_tables(seq)
        for group in self.groups:
            group.trim(seq, num_tokens)

    def free(self, seq: Sequence) -> None:
        self._ensure_tables(seq)
        for group in self.groups:
            group.free(seq)

    def take_fresh_slots(self) -> list[int]:
        """State slots handed out since the last call: the next step zeroes them before it runs."""
        return self.recurrent.take_fresh() if self.recurrent is not None else []

    def stats(self) -> dict[str, int]:
        rec = self.recurrent
        return {
            "kv_blocks_total": self.pool.num_usable,
            "kv_blocks_used": self.pool.num_used,
            "state_slots_total": rec.num_slots - 1 if rec else 0,
            "state_slots_used": rec.num_used if rec else 0,
            "state_snapshots_total": rec.num_snapshots if rec else 0,
            "state_snapshots_used": rec.num_snapshots - rec.num_free_snapshots if rec else 0,
        }
