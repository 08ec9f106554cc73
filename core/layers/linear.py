"""Linear layers of every model: replicated, column- and row-parallel, stacked (q/k/v, gate/up), with weight loaders.

Each layer asks the build-time ``QuantConfig`` for its ``QuantMethod``, which registers the
parameters (``weight``, and e.g. ``weight_scale``) with this tensor-parallel rank's shapes; the
layer adds ``bias`` (params dtype) when asked. ``forward(x)`` is
``quant_method.apply(self, x, bias)``: unquantized, exactly ``ops.linear(x, weight, bias)``.
Parameters are created uninitialised on the default device; the checkpoint fills them.

Loading: every parameter has ``weight_loader(param, loaded, shard_id=None)``. ``loaded`` is the
checkpoint tensor as stored (all ranks' rows and columns: the loader takes this rank's slice);
``shard_id`` names the slot of a stacked layer (``QKVParallelLinear``: "q" / "k" / "v";
``MergedColumnParallelLinear``: the index into ``output_sizes``); None loads the whole
parameter (for a stacked layer: a checkpoint tensor that is already the stack). A shape that does
not fit raises ``WeightLoadError`` naming the parameter and both shapes. The loader returns the
index it wrote into ``param`` (for ``LoadedRows``).

Tensor parallelism reads ``get_parallel()`` at construction: ``ColumnParallelLinear`` keeps
``output_size / tp_size`` rows, ``RowParallelLinear`` ``input_size / tp_size`` columns and sums
its output over the group; size 1 (today) is the whole layer and launches nothing extra.
"""
from __future__ import annotations

import torch
from torch import nn

from armillary.errors import WeightLoadError
from armillary.layers.collectives import all_reduce
from armillary.layers.loading import Index, copy_checked
from armillary.layers.quantization.base import QuantConfig, register_weight
from armillary.layers.quantization.context import get_quant_config
from armillary.parallel import get_parallel

# one stacked slot along the output: (full rows S in the checkpoint, rows n this rank keeps,
# where they go in the parameter, where they start in the checkpoint tensor), in logical rows
Slot = tuple[int, int, int, int]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _in_units(offset: int, block: int, what: str) -> int:
    """A logical row / column offset in units of ``block`` elements (must fall on a block edge)."""
    if offset % block:
        raise WeightLoadError(f"{what}: offset {offset} is not a multiple of the parameter's block of {block}")
    return offset // block


class LinearBase(nn.Module):
    """``input_size`` -> ``output_size`` (full sizes; this rank holds ``input_size_per_partition``
    columns and ``output_partition_sizes`` rows per stacked slot). Subclasses say how the output
    rows and input columns are cut (``_slots``, ``_input_slice``)."""

    def __init__(self, input_size: int, output_size: int, bias: bool, input_size_per_partition: int,
                 output_partition_sizes: list[int], quant_config: QuantConfig | None, prefix: str) -> None:
        super().__init__()
        self.input_size, self.output_size, self.prefix = input_size, output_size, prefix
        self.input_size_per_partition = input_size_per_partition
        self.output_partition_sizes = list(output_partition_sizes)
        self.output_size_per_partition = sum(self.output_partition_sizes)
        params_dtype = torch.get_default_dtype()
        self.quant_method = (quant_config or get_quant_config()).linear_method(self, prefix)
        self.quant_method.create_weights(self, input_size_per_partition, self.output_partition_sizes, input_size,
                                         output_size, params_dtype)
        if bias:
            register_weight(self, "bias", torch.empty(self.output_size_per_partition, dtype=params_dtype),
                            output_dim=0)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)

    # ---- how this layer's rows and columns map onto the checkpoint (subclasses)

    def _slots(self, shard_id: object) -> list[Slot]:
        """The output slots ``shard_id`` fills (None: every slot, in order)."""
        if shard_id is not None:
            raise WeightLoadError(f"{self._what()} has one slot and takes no shard (got {shard_id!r})")
        return [(self.output_size, self.output_size, 0, 0)]

    def _shard_index(self, shard_id: object) -> int:
        """Entry of a ``per_shard`` parameter that ``shard_id`` fills."""
        self._slots(shard_id)  # validates
        return 0

    def _input_slice(self) -> tuple[int, int]:
        """(start in the checkpoint's columns, columns this rank keeps), logical columns."""
        return 0, self.input_size

    # ---- loading

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> Index:
        """Copy checkpoint tensor ``loaded`` (or this rank's slice of it) into ``param``'s slot
        ``shard_id``; returns the index written. See the module docstring."""
        what = self._what(param)
        if getattr(param, "per_shard", False):
            if shard_id is None:
                return copy_checked(param, (), loaded.reshape(param.shape) if loaded.numel() == param.numel()
                                    else loaded, what)
            k = self._shard_index(shard_id)
            target = param.data[k]
            return copy_checked(param, (k,), loaded.reshape(target.shape) if loaded.numel() == target.numel()
                                else loaded, what)
        out_dim = getattr(param, "output_dim", None)
        if out_dim is None:
            if shard_id is not None:
                self._slots(shard_id)  # validates
            return copy_checked(param, (), loaded, what)  # e.g. a per-tensor input scale, the same for every slot
        slots = self._slots(shard_id)
        block = getattr(param, "output_block", 1)
        full_rows = [_cdiv(s, block) for s, _, _, _ in slots]
        if len(slots) > 1 and loaded.dim() == param.dim() and loaded.shape[out_dim] == sum(full_rows):
            pieces = loaded.split(full_rows, dim=out_dim)  # an already-stacked checkpoint tensor: slot by slot
        elif len(slots) > 1:
            raise WeightLoadError(f"{what}: a stacked checkpoint tensor needs {sum(full_rows)} rows along dim "
                                  f"{out_dim}, got shape {tuple(loaded.shape)}")
        else:
            pieces = (loaded,)
        index: Index = ()
        for slot, piece in zip(slots, pieces):
            index = self._load_slot(param, piece, slot, out_dim, block, what)
        return index if len(slots) == 1 else ()

    def _load_slot(self, param: nn.Parameter, loaded: torch.Tensor, slot: Slot, out_dim: int, block: int,
                   what: str) -> Index:
        full, rows, dst, src = slot
        count = _cdiv(rows, block)
        dst, src = _in_units(dst, block, what), _in_units(src, block, what)
        expected = list(param.shape)
        expected[out_dim] = _cdiv(full, block)
        in_dim = getattr(param, "input_dim", None)
        if in_dim is not None:
            in_block = getattr(param, "input_block", 1)
            col_start, cols = self._input_slice()
            expected[in_dim] = _cdiv(self.input_size, in_block)
        if list(loaded.shape) != expected:
            raise WeightLoadError(f"{what}: expects a checkpoint tensor of shape {tuple(expected)} "
                                  f"(this rank keeps {tuple(param.shape)}), got {tuple(loaded.shape)}")
        loaded = loaded.narrow(out_dim, src, count)
        if in_dim is not None:
            loaded = loaded.narrow(in_dim, _in_units(col_start, in_block, what), _cdiv(cols, in_block))
        index = [slice(None)] * (out_dim + 1)
        index[out_dim] = slice(dst, dst + count)
        return copy_checked(param, tuple(index), loaded, what)

    def _what(self, param: nn.Parameter | None = None) -> str:
        name = next((n for n, p in self.named_parameters(recurse=False) if p is param), "?") if param is not None \
            else ""
        owner = self.prefix or type(self).__name__
        return f"{owner}.{name}" if name else owner

    def extra_repr(self) -> str:
        return (f"in={self.input_size_per_partition}/{self.input_size}, out={self.output_partition_sizes}/"
                f"{self.output_size}, bias={self.bias is not None}, method={type(self.quant_method).__name__}")


class ReplicatedLinear(LinearBase):
    """The whole ``input_size -> output_size`` layer on every rank (routers, small heads).

    Parameters: ``weight`` [output_size, input_size] (unquantized; a quant method may add
    others), ``bias`` [output_size] if ``bias``. ``weight_loader`` takes the checkpoint tensor
    whole, no shard.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False, *,
                 quant_config: QuantConfig | None = None, prefix: str = "") -> None:
        super().__init__(input_size, output_size, bias, input_size, [output_size], quant_config, prefix)


class ColumnParallelLinear(LinearBase):
    """Output rows split over tensor parallelism: this rank keeps rows
    ``[tp_rank * n, (tp_rank + 1) * n)``, n = output_size / tp_size; its output is this rank's
    slice (feed it to a ``RowParallelLinear``, or gather it).

    Parameters: ``weight`` [n, input_size], ``bias`` [n]. ``weight_loader`` takes the full
    checkpoint tensor [output_size, input_size] and keeps this rank's rows; no shard.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False, *,
                 quant_config: QuantConfig | None = None, prefix: str = "",
                 output_sizes: list[int] | None = None) -> None:
        par = get_parallel()
        self.tp_rank, self.tp_size = par.tp_rank, par.tp_size
        self.output_sizes = list(output_sizes or [output_size])
        if sum(self.output_sizes) != output_size:
            raise ValueError(f"output_sizes {self.output_sizes} do not add up to output_size {output_size}")
        local = [par.shard(s, f"output slot of {prefix or type(self).__name__}")[1] for s in self.output_sizes]
        super().__init__(input_size, output_size, bias, input_size, local, quant_config, prefix)

    def _slots(self, shard_id: object) -> list[Slot]:
        if shard_id is not None:
            raise WeightLoadError(f"{self._what()} has one slot and takes no shard (got {shard_id!r})")
        rows = self.output_partition_sizes[0]
        return [(self.output_size, rows, 0, self.tp_rank * rows)]


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input stacked into one GEMM, e.g. gate and
    up (``output_sizes=[I, I]``) or Gated DeltaNet's [q | k | v | z | b | a].

    Each slot i is split over tensor parallelism on its own, so this rank's ``weight`` is
    [sum(output_sizes) / tp_size, input_size] with rows [slot 0's share | slot 1's share | ...];
    ``bias`` likewise. ``weight_loader(param, loaded, shard_id=i)`` takes checkpoint tensor i
    [output_sizes[i], input_size] whole and keeps this rank's rows of it; ``shard_id=None`` takes
    an already-stacked checkpoint tensor [sum(output_sizes), input_size].
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, *,
                 quant_config: QuantConfig | None = None, prefix: str = "") -> None:
        super().__init__(input_size, sum(output_sizes), bias, quant_config=quant_config, prefix=prefix,
                         output_sizes=output_sizes)

    def _shard_index(self, shard_id: object) -> int:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise WeightLoadError(f"{self._what()}: shard_id must be an index below {len(self.output_sizes)}, "
                                  f"not {shard_id!r}")
        return shard_id

    def _slots(self, shard_id: object) -> list[Slot]:
        ids = range(len(self.output_sizes)) if shard_id is None else [self._shard_index(shard_id)]
        starts = [sum(self.output_partition_sizes[:i]) for i in range(len(self.output_sizes))]
        return [(self.output_sizes[i], self.output_partition_sizes[i], starts[i],
                 self.tp_rank * self.output_partition_sizes[i]) for i in ids]


class QKVParallelLinear(ColumnParallelLinear):
    """Query, key and value projections stacked: rows [q | k | v], split over tensor parallelism
    by heads.

    ``q_size`` (default ``num_heads * head_size``) is the full query width, for layouts with more
    than one head-sized block per head (Qwen's gated attention: per head [query | gate], so
    ``q_size = 2 * num_heads * head_size``); it is cut into ``tp_size`` equal parts, so keep a
    head's rows together. Key and value heads are split when ``num_kv_heads >= tp_size`` and
    replicated (one per rank) otherwise. After construction ``num_heads``, ``num_kv_heads``,
    ``q_size`` and ``kv_size`` are this rank's.

    Parameters: ``weight`` [q_size + 2 * kv_size, hidden_size], ``bias`` likewise.
    ``weight_loader(param, loaded, shard_id)``: "q" takes checkpoint ``q_proj`` [q_size_full,
    hidden], "k" / "v" take ``k_proj`` / ``v_proj`` [num_kv_heads_full * head_size, hidden];
    None takes a checkpoint tensor already stacked [q | k | v].
    """

    SHARDS = ("q", "k", "v")

    def __init__(self, hidden_size: int, head_size: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 q_size: int | None = None, *, quant_config: QuantConfig | None = None, prefix: str = "") -> None:
        tp = get_parallel().tp_size
        if num_heads % tp or (num_kv_heads % tp and tp % num_kv_heads):
            raise ValueError(f"{num_heads} query / {num_kv_heads} key-value heads do not split over "
                             f"tensor-parallel size {tp}")
        self.head_size = head_size
        self.total_num_heads, self.total_num_kv_heads = num_heads, num_kv_heads
        self.num_heads = num_heads // tp
        self.num_kv_heads = get_parallel().kv_heads(num_kv_heads)
        self.kv_replicas = max(1, tp // num_kv_heads)  # ranks holding each key-value head
        self.total_q_size = q_size if q_size is not None else num_heads * head_size
        self.total_kv_size = num_kv_heads * head_size
        self.q_size = self.total_q_size // tp
        self.kv_size = self.num_kv_heads * head_size
        kv_rows = self.total_kv_size if tp <= num_kv_heads else head_size * tp  # per-rank slices add up
        super().__init__(hidden_size, self.total_q_size + 2 * kv_rows, bias, quant_config=quant_config,
                         prefix=prefix, output_sizes=[self.total_q_size, kv_rows, kv_rows])
        self.output_size = self.total_q_size + 2 * self.total_kv_size  # the checkpoint's stacked rows

    def _shard_index(self, shard_id: object) -> int:
        if shard_id not in self.SHARDS:
            raise WeightLoadError(f"{self._what()}: shard_id must be 'q', 'k' or 'v', not {shard_id!r}")
        return self.SHARDS.index(shard_id)

    def _slots(self, shard_id: object) -> list[Slot]:
        ids = range(3) if shard_id is None else [self._shard_index(shard_id)]
        kv_src = (self.tp_rank // self.kv_replicas) * self.kv_size
        table = [(self.total_q_size, self.q_size, 0, self.tp_rank * self.q_size),
                 (self.total_kv_size, self.kv_size, self.q_size, kv_src),
                 (self.total_kv_size, self.kv_size, self.q_size + self.kv_size, kv_src)]
        return [table[i] for i in ids]


class RowParallelLinear(LinearBase):
    """Input columns split over tensor parallelism (the input is a column-parallel layer's
    output slice): this rank keeps columns ``[tp_rank * k, (tp_rank + 1) * k)``, k = input_size /
    tp_size, and the partial outputs are summed over the group (unless ``reduce_results`` is
    False: then the caller sums, e.g. once for two branches). The bias is added once (rank 0).

    Parameters: ``weight`` [output_size, k], ``bias`` [output_size]. ``weight_loader`` takes the
    full checkpoint tensor [output_size, input_size] and keeps this rank's columns; no shard.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False, *, reduce_results: bool = True,
                 quant_config: QuantConfig | None = None, prefix: str = "") -> None:
        par = get_parallel()
        self.tp_rank, self.tp_size = par.tp_rank, par.tp_size
        self.reduce_results = reduce_results
        cols = par.shard(input_size, f"input of {prefix or type(self).__name__}")[1]
        super().__init__(input_size, output_size, bias, cols, [output_size], quant_config, prefix)

    def _input_slice(self) -> tuple[int, int]:
        return self.tp_rank * self.input_size_per_partition, self.input_size_per_partition

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.quant_method.apply(self, x, self.bias if self.tp_rank == 0 else None)
        return all_reduce(out, self.tp_size) if self.reduce_results else out
