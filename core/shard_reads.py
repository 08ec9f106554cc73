"""Checkpoint tensors that read only the part a rank keeps: ``narrow`` and leading-dimension indexing are free, the
bytes come off the file (memory-mapped) when anything else touches the tensor.

Under tensor / expert parallelism the shared layers' loaders narrow each checkpoint tensor to their slice before
they copy it (rows of a column-parallel weight, columns of a row-parallel one, whole experts), so a rank that gets
``LazySlice`` tensors (``lazy_safetensors``) copies only its shard out of the file, never the whole tensor, and the
OS pages in only the pages that slice touches. Any other operation (a plugin's reshape, a cat, a cast) reads the
viewed bytes then and runs on the real tensor: correct for every loader, lean for those that narrow first.
``BYTES_READ`` counts the bytes materialised in this process (tests, logs).
"""
from __future__ import annotations

import mmap
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils._pytree import tree_map

from armillary.safetensors_stream import read_header

BYTES_READ = [0]  # bytes this process has copied out of checkpoint files through LazySlice
_MAPS: dict[str, mmap.mmap] = {}
_SHAPE_OPS = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.element_size,
              torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.ndim.__get__,
              torch.Tensor.is_floating_point, torch.Tensor.is_contiguous}


class LazySlice(torch.Tensor):
    """A view ``(offset, sizes, strides)`` in elements of one tensor stored row-major at byte ``begin`` of ``path``;
    a meta tensor of the view's shape stands in until the bytes are needed."""

    @staticmethod
    def __new__(cls, path: str, begin: int, dtype: torch.dtype, sizes: tuple[int, ...],
                strides: tuple[int, ...] | None = None, offset: int = 0):
        self = torch.Tensor._make_subclass(cls, torch.empty(sizes, dtype=dtype, device="meta"))
        self.path, self.begin, self.offset = path, begin, offset
        self.view_strides = strides if strides is not None else torch.empty(sizes, device="meta").stride()
        return self

    def _sub(self, sizes, strides, offset) -> LazySlice:
        return LazySlice(self.path, self.begin, self.dtype, tuple(sizes), tuple(strides), offset)

    def narrowed(self, dim: int, start: int, length: int) -> LazySlice:
        dim = dim % self.dim()
        if start < 0 or length < 0 or start + length > self.shape[dim]:
            raise IndexError(f"narrow {start}:{start + length} out of dimension {dim} of size {self.shape[dim]}")
        sizes = list(self.shape)
        sizes[dim] = length
        return self._sub(sizes, self.view_strides, self.offset + start * self.view_strides[dim])

    def indexed(self, index) -> LazySlice | None:
        """An int or step-1 slices on leading dimensions as a LazySlice; None for anything else."""
        items = index if isinstance(index, tuple) else (index,)
        view, dim = self, 0
        for item in items:
            if isinstance(item, int) and not isinstance(item, bool):
                pos = item + view.shape[dim] if item < 0 else item
                view = view.narrowed(dim, pos, 1)
                view = view._sub(view.shape[:dim] + view.shape[dim + 1:],
                                 view.view_strides[:dim] + view.view_strides[dim + 1:], view.offset)
            elif isinstance(item, slice) and item.step in (None, 1):
                start, stop, _ = item.indices(view.shape[dim])
                view = view.narrowed(dim, start, max(0, stop - start))
                dim += 1
            else:
                return None
        return view

    def materialize(self) -> torch.Tensor:
        """The viewed elements as a new contiguous CPU tensor, read from the memory-mapped file."""
        data = _map(self.path)
        numel = self.numel()
        if numel == 0:
            return torch.empty(self.shape, dtype=self.dtype)
        last = self.offset + sum((s - 1) * st for s, st in zip(self.shape, self.view_strides))  # last element read
        first_byte = self.begin + self.offset * self.dtype.itemsize
        span = (last - self.offset + 1) * self.dtype.itemsize
        with warnings.catch_warnings():  # the map is read-only and nothing writes through it
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(data, dtype=torch.uint8, count=span, offset=first_byte)
        out = raw.view(self.dtype).as_strided(self.shape, self.view_strides).clone()
        BYTES_READ[0] += out.numel() * out.element_size()
        return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        this = args[0] if args and isinstance(args[0], LazySlice) else None
        if this is not None and func in (torch.Tensor.narrow, torch.narrow):
            dim, start, length = list(args[1:]) + [kwargs[k] for k in ("dim", "start", "length") if k in kwargs]
            return this.narrowed(int(dim), int(start), int(length))
        if this is not None and func is torch.Tensor.__getitem__:
            view = this.indexed(args[1])
            if view is not None:
                return view
        if this is not None and func in _SHAPE_OPS:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if this is not None and func == torch.Tensor.device.__get__:  # a fresh method-wrapper per access: ==
            return torch.device("cpu")  # where the bytes land
        real = tree_map(lambda a: a.materialize() if isinstance(a, LazySlice) else a, (args, kwargs))
        return func(*real[0], **real[1])


def _map(path: str) -> mmap.mmap:
    if path not in _MAPS:
        with open(path, "rb") as f:
            _MAPS[path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return _MAPS[path]


def close_maps() -> None:
    """Unmap the files (after a load)."""
    for data in _MAPS.values():
        data.close()
    _MAPS.clear()


def lazy_safetensors(shards: list[Path]) -> Iterator[tuple[str, LazySlice]]:
    """``(checkpoint name, LazySlice)`` for every tensor of ``shards``, in file order; nothing is read here."""
    for shard in shards:
        for entry in read_header(shard):
            yield entry.name, LazySlice(str(shard), entry.begin, entry.dtype, entry.shape)
