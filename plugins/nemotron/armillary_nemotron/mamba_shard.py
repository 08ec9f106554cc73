"""Which part of a Mamba-2 mixer a tensor-parallel rank holds: its heads, their groups, the rows and channels of each.

Heads split evenly (rank r: heads ``[r·H/N, (r+1)·H/N)``). The B / C groups follow the heads: when
n_groups G splits over N ranks each rank keeps G / N of them (its heads' groups, since the H / G heads
of a group are consecutive); when N is a multiple of G every rank's heads sit inside one group, which
those N / G ranks all keep (replicated, as vLLM's mixer does). Any other layout would give a rank
heads of two groups with a part of each, and is refused. The gated RMSNorm keeps the checkpoint's
group size (d_inner / G channels): with G >= N each rank holds whole norm groups, otherwise a group
spans N / G ranks and its statistics are summed over them (``Mamba2Mixer.gated_norm``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from armillary.layers import MergedColumnParallelLinear
from armillary.layers.loading import Index
from armillary.layers.linear import Slot
from armillary.parallel import get_parallel
from armillary_nemotron.config import NemotronHArgs

Rows = tuple[int, int]  # (start in the checkpoint's rows / channels, count this rank keeps)


@dataclass(frozen=True, slots=True)
class MambaShard:
    """This rank's heads and groups of a mixer with ``total_heads`` heads and ``total_groups`` groups."""

    tp_rank: int
    tp_size: int
    total_heads: int
    total_groups: int
    head_dim: int
    state_size: int
    heads: int  # this rank's
    groups: int  # this rank's (1 when a group is replicated over several ranks)

    @property
    def head_start(self) -> int:
        return self.tp_rank * self.heads

    @property
    def group_start(self) -> int:
        """The first group this rank keeps: r·G/N when G splits, else the group of its heads (r // (N/G))."""
        return self.tp_rank * self.total_groups // self.tp_size

    @property
    def d_inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of this rank's conv: its x (d_inner) ‖ B ‖ C (groups · state each)."""
        return self.d_inner + 2 * self.groups * self.state_size

    @property
    def norm_group_size(self) -> int:
        """The checkpoint's norm group, d_inner / G channels, whatever the split."""
        return self.total_heads * self.head_dim // self.total_groups

    @property
    def norm_across_ranks(self) -> bool:
        """True when a norm group is larger than this rank's channels (G < N): its statistics need a sum."""
        return self.norm_group_size > self.d_inner

    def in_proj_rows(self) -> list[tuple[int, Rows]]:
        """Per slot of in_proj's rows z | x | B | C | dt: (the checkpoint slot's rows, this rank's part of them)."""
        full_d, gn = self.total_heads * self.head_dim, self.total_groups * self.state_size
        heads = (self.head_start * self.head_dim, self.d_inner)
        groups = (self.group_start * self.state_size, self.groups * self.state_size)
        return [(full_d, heads), (full_d, heads), (gn, groups), (gn, groups),
                (self.total_heads, (self.head_start, self.heads))]

    def conv_channels(self) -> list[Rows]:
        """The checkpoint's conv channels (x ‖ B ‖ C over every head / group) this rank keeps, in its order."""
        full_d, gn = self.total_heads * self.head_dim, self.total_groups * self.state_size
        own = self.groups * self.state_size
        start = self.group_start * self.state_size
        return [(self.head_start * self.head_dim, self.d_inner), (full_d + start, own), (full_d + gn + start, own)]


def mamba_shard(cfg: NemotronHArgs) -> MambaShard:
    """This rank's share of the config's mixer (inside ``use_parallel``; the whole mixer at size 1)."""
    par = get_parallel()
    tp, heads, groups = par.tp_size, cfg.mamba_heads, cfg.n_groups
    if heads % groups:
        raise ValueError(f"mamba_num_heads {heads} is not a multiple of n_groups {groups}")
    if heads % tp:
        raise ValueError(f"mamba_num_heads {heads} does not split over tensor-parallel size {tp}")
    if groups % tp and tp % groups:
        raise ValueError(f"n_groups {groups} and tensor-parallel size {tp}: the Mamba groups neither split over the "
                         f"ranks nor does each rank's share of the heads fall inside one group (one must divide the "
                         f"other); use a tensor-parallel size that divides or is a multiple of {groups}")
    return MambaShard(tp_rank=par.tp_rank, tp_size=tp, total_heads=heads, total_groups=groups,
                      head_dim=cfg.mamba_head_dim, state_size=cfg.state_size, heads=heads // tp,
                      groups=max(1, groups // tp))


class MambaInProj(MergedColumnParallelLinear):
    """in_proj over tensor parallelism: rows [z | x | B | C | dt] of this rank's heads and groups.

    A ``MergedColumnParallelLinear`` of five slots whose parts are this rank's ``in_proj_rows`` rather than
    equal slices, since replicated groups give every rank of a group the same B / C rows. Loads the
    checkpoint's stacked ``in_proj.weight`` (and bias) whole, shard None; slot i alone with shard_id i.
    """

    def __init__(self, hidden_size: int, shard: MambaShard, bias: bool, prefix: str = "") -> None:
        self.rows = shard.in_proj_rows()
        # equal shards of N x this rank's rows give this rank's rows; _slots says where they come from
        super().__init__(hidden_size, [shard.tp_size * n for _, (_, n) in self.rows], bias, prefix=prefix)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> Index:
        if shard_id is None and getattr(param, "per_shard", False) and loaded.numel() == 1:
            # a per-tensor value of the checkpoint's one in_proj tensor (ModelOpt FP8's weight_scale / input_scale,
            # NVFP4's global scale) holds for all five slots it is cut into here
            for i in range(len(self.rows)):
                super().weight_loader(param, loaded, i)
            return ()
        return super().weight_loader(param, loaded, shard_id)

    def _slots(self, shard_id: object) -> list[Slot]:
        ids = range(len(self.rows)) if shard_id is None else [self._shard_index(shard_id)]
        starts = [sum(self.output_partition_sizes[:i]) for i in range(len(self.rows))]
        return [(self.rows[i][0], self.rows[i][1][1], starts[i], self.rows[i][1][0]) for i in ids]
