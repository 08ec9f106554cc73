"""Recurrent states on the device (GDN, Mamba-2): one row per slot or snapshot, every layer in the row.

Each recurrent layer's tensors are views ``[rows, *shape]`` into one flat byte buffer, so a
sequence's whole state (all layers) is one row: zeroing fresh slots and copying slots to
snapshots and back are one device op each, whatever the number of layers.
"""
from __future__ import annotations

import torch


class StatePool:
    """``buffer: [rows, bytes_per_row]`` uint8; rows are state slots then snapshot rows."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer

    @property
    def num_rows(self) -> int:
        return self.buffer.shape[0]

    def _index(self, rows: list[int]) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.long).to(self.buffer.device, non_blocking=True)

    def zero(self, rows: list[int]) -> None:
        """Fresh states for sequences that start from nothing."""
        if rows:
            self.buffer.index_fill_(0, self._index(rows), 0)

    def copy(self, src: list[int], dst: list[int]) -> None:
        """Row ``dst[i]`` := row ``src[i]`` for all i at once (snapshot, restore); rows must not overlap."""
        if len(src) != len(dst):
            raise ValueError("copy needs as many sources as destinations")
        if src:
            if set(src) & set(dst):
                raise ValueError("a state copy's sources and destinations overlap")
            self.buffer.index_copy_(0, self._index(dst), self.buffer.index_select(0, self._index(src)))
