"""The recurrent group: one state slot per running sequence (GDN, Mamba-2) and a snapshot budget."""
from __future__ import annotations

from collections.abc import Callable

from armillary.memory.groups.base import CacheGroup
from armillary.sequence import Sequence


class RecurrentGroup(CacheGroup):
    """Slot ids ``0..num_slots-1`` (minus the scratch slot) for running sequences; snapshot ids
    ``num_slots..num_slots+num_snapshots-1`` name rows of the same state tensors that hold copies.

    A state covers every position a sequence has computed, so trimming cannot give positions back:
    rolling a state back is a snapshot restore (or, for speculation, a per-position state).
    ``fresh`` lists the slots handed out since the last ``take_fresh``: the plan zeroes them.
    """

    uses_blocks = False

    def __init__(self, group_id: int, layers: tuple[int, ...], num_slots: int, scratch_slot: int,
                 num_snapshots: int = 0) -> None:
        super().__init__(group_id, layers)
        self.num_slots = num_slots
        self.scratch_slot = scratch_slot
        self.free_slots = [s for s in range(num_slots - 1, -1, -1) if s != scratch_slot]  # pop() = lowest
        self.num_snapshots = num_snapshots
        self.free_snapshots = list(range(num_slots + num_snapshots - 1, num_slots - 1, -1))
        self.fresh: list[int] = []
        self.evict_snapshot: Callable[[], int | None] | None = None  # prefix caching: the LRU cached row

    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    @property
    def num_used(self) -> int:
        return self.num_slots - 1 - len(self.free_slots)

    def num_needed(self, seq: Sequence, num_tokens: int) -> int:
        return 0 if seq.state_slot is not None else 1

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        if seq.state_slot is None:
            seq.state_slot = self.free_slots.pop()
            self.fresh.append(seq.state_slot)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        return None

    def free(self, seq: Sequence) -> None:
        slot = self.detach(seq)
        if slot is not None:
            self.free_slot(slot)

    def detach(self, seq: Sequence) -> int | None:
        """Take ``seq``'s slot away from it without freeing it (its state is still to be copied)."""
        slot, seq.state_slot = seq.state_slot, None
        if slot is not None and slot in self.fresh:
            self.fresh.remove(slot)
        return slot

    def free_slot(self, slot: int) -> None:
        self.free_slots.append(slot)

    def take_fresh(self) -> list[int]:
        fresh, self.fresh = self.fresh, []
        return fresh

    # ---- snapshots: budgeted rows of the state tensors

    @property
    def num_free_snapshots(self) -> int:
        return len(self.free_snapshots)

    def new_snapshot(self) -> int | None:
        """A snapshot row id (with prefix caching, the least recently used cached one when none is
        free), or None when the budget is spent."""
        if self.free_snapshots:
            return self.free_snapshots.pop()
        return self.evict_snapshot() if self.evict_snapshot is not None else None

    def free_snapshot(self, snapshot: int) -> None:
        if not self.num_slots <= snapshot < self.num_slots + self.num_snapshots:
            raise ValueError(f"{snapshot} is not a snapshot id")
        self.free_snapshots.append(snapshot)

    def describe(self) -> str:
        return f"RecurrentGroup(layers {len(self.layers)}, {self.num_slots} slots, {self.num_snapshots} snapshots)"
