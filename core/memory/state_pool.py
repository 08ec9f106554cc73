"""Recurrent-state slots (GDN, Mamba-2): one per running sequence, zeroed when handed out."""
from __future__ import annotations

import torch


class StatePool:
    """Slot ids ``0..num_slots-1`` over every recurrent layer's ``[num_slots, *shape]`` tensors."""

    def __init__(self, num_slots: int, tensors: list[torch.Tensor]) -> None:
        self.num_slots = num_slots
        self.tensors = tensors  # every recurrent layer's state tensors, flattened
        self.free_ids = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest id first

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self.free_ids)

    def allocate(self) -> int:
        """A zeroed slot; the caller checked ``num_free``."""
        if not self.free_ids:
            raise RuntimeError("no free state slot")
        slot = self.free_ids.pop()
        for t in self.tensors:
            t[slot].zero_()
        return slot

    def free(self, slot: int) -> None:
        self.free_ids.append(slot)
