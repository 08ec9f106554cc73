"""Recurrent-state snapshots part-way through a prefill chunk (``ForwardBatch.state_snapshots``).

Prefix caching checkpoints a sequence's state every few hundred tokens. Ending the step's chunk at
the checkpoint costs a whole extra step (every layer, the sampler, the host's launches); instead a
Gated DeltaNet layer runs its delta rule in two passes: every sequence up to its checkpoint (the
others whole), the slot's state then copied to the snapshot row, then the rest from the slot. The
passes compute exactly what two steps would (the same chunks from the same states), so a later hit
on the snapshot equals a miss. The conv window at the checkpoint is the chunk's own inputs there.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class SplitChunks:
    """The two passes over a step's packed tokens, as device index tensors (built once per step)."""

    first_rows: torch.Tensor  # [T1] every sequence up to its checkpoint, or whole
    first_cu: list[int]
    first_cu_dev: torch.Tensor  # [B + 1] int32
    second_rows: torch.Tensor  # [T2] the sequences with a checkpoint, from it to their chunk's end
    second_cu: list[int]
    second_cu_dev: torch.Tensor
    second_seqs: torch.Tensor  # [B2] their batch indices
    snap_seqs: torch.Tensor  # [S] batch index of each snapshot, in ``state_snapshots`` order
    snap_rows: torch.Tensor  # [S] its snapshot row


_SPLITS: OrderedDict[tuple, SplitChunks] = OrderedDict()  # every GDN layer of a step asks for the same split
_SPLITS_KEPT = 8


def _on(device: torch.device, values: list[int], dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A host list on ``device``; through pinned memory on CUDA, so the copy does not wait for the stream."""
    host = torch.tensor(values, dtype=dtype)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)


def split_chunks(bounds: list[int], snapshots: list[tuple[int, int, int]], device: torch.device) -> SplitChunks:
    """``bounds``: the step's host cu_seqlens [B + 1]; ``snapshots``: (b, n, row) with 0 < n <= length of b."""
    key = (tuple(bounds), tuple(snapshots), device)
    hit = _SPLITS.get(key)
    if hit is not None:
        return hit
    cut = {b: n for b, n, _ in snapshots}
    first_rows, first_cu, second_rows, second_cu, second_seqs = [], [0], [], [0], []
    for b in range(len(bounds) - 1):
        lo, hi = bounds[b], bounds[b + 1]
        mid = lo + cut[b] if b in cut else hi
        if not lo < mid <= hi:
            raise ValueError(f"state snapshot of sequence {b} after {mid - lo} of its {hi - lo} tokens")
        first_rows.extend(range(lo, mid))
        first_cu.append(len(first_rows))
        if mid < hi:
            second_rows.extend(range(mid, hi))
            second_cu.append(len(second_rows))
            second_seqs.append(b)
    split = SplitChunks(_on(device, first_rows), first_cu, _on(device, first_cu, torch.int32), _on(device, second_rows),
                        second_cu, _on(device, second_cu, torch.int32), _on(device, second_seqs),
                        _on(device, [b for b, _, _ in snapshots]), _on(device, [r for _, _, r in snapshots]))
    _SPLITS[key] = split
    if len(_SPLITS) > _SPLITS_KEPT:
        _SPLITS.popitem(last=False)
    return split


def conv_windows(before: torch.Tensor, inputs: torch.Tensor, bounds: list[int],
                 snapshots: list[tuple[int, int, int]]) -> torch.Tensor:
    """The conv window after each snapshot's first n tokens: ``before`` [S, C, W - 1] (the slots' windows
    at the step's start), ``inputs`` [T, C] (the conv's inputs) -> [S, C, W - 1] in ``before``'s dtype."""
    width = before.shape[-1]
    out = []
    for i, (b, n, _) in enumerate(snapshots):
        lo = bounds[b]
        new = inputs[max(lo, lo + n - width): lo + n].t().to(before.dtype)  # [C, <= W - 1]
        out.append(torch.cat((before[i], new), dim=-1)[:, -width:])
    return torch.stack(out)


Rule = Callable[[torch.Tensor, list[int], torch.Tensor, torch.Tensor], torch.Tensor]


def two_pass(rule: Rule, split: SplitChunks, num_tokens: int, state_slots: torch.Tensor,
             ssm_states: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``rule(rows, cu_seqlens, cu_seqlens on the device, slots)`` runs the delta rule over those rows of the
    step from and into ``slots``' states and returns their outputs; -> outputs of all ``num_tokens`` rows
    (``like``'s trailing shape and dtype), each snapshot row holding its sequence's state at its checkpoint."""
    out = torch.empty((num_tokens, *like.shape[1:]), dtype=like.dtype, device=like.device)
    out[split.first_rows] = rule(split.first_rows, split.first_cu, split.first_cu_dev, state_slots)
    ssm_states[split.snap_rows] = ssm_states[state_slots[split.snap_seqs]]
    if split.second_rows.numel():
        out[split.second_rows] = rule(split.second_rows, split.second_cu, split.second_cu_dev,
                                      state_slots[split.second_seqs])
    return out
