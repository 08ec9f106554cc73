"""Safetensors shards straight to the device: reader threads prefetch byte ranges while earlier ones are copied in.

Every shard's header is parsed up front; the tensors of each shard are grouped into batches of
consecutive bytes (at most ``batch_bytes``, or one larger tensor), and each batch into chunks
of at most ``chunk_bytes``. Reader threads ``preadv`` the chunks, in order and a window of
``num_slots`` ahead, across shard boundaries: while the caller's ``load_weights`` copies one
batch into the parameters, the next chunks (the next shard's too) are already being read. On
CUDA a chunk lands in one of ``num_slots`` pinned staging buffers and is copied to the batch's
device buffer with a non-blocking transfer on the current stream; a reader reuses a slot only
after the event recorded behind that copy. On the CPU chunks are read straight into the batch.
The yielded tensors are views of their batch buffer (``load_weights`` runs its copies, casts and
slices on the device); the buffer is freed when the last view is dropped.
"""
from __future__ import annotations

import json
import logging
import os
import struct
import sys
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from armillary.errors import WeightLoadError

log = logging.getLogger("armillary")

MiB = 1 << 20
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "C64": torch.complex64,
}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"), ("F8_E4M3FNUZ", "float8_e4m3fnuz"),
                     ("F8_E5M2FNUZ", "float8_e5m2fnuz"), ("F8_E8M0", "float8_e8m0fnu"), ("U16", "uint16"),
                     ("U32", "uint32"), ("U64", "uint64")):
    if hasattr(torch, _attr):  # newer torch builds only
        _DTYPES[_name] = getattr(torch, _attr)


@dataclass(slots=True)
class TensorEntry:
    """One tensor of a shard: its bytes are ``[begin, end)`` of the file."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(slots=True)
class Batch:
    """Consecutive tensors of one shard read into one buffer: file bytes ``[begin, end)``."""

    shard: int
    begin: int
    end: int
    entries: list[TensorEntry]


@dataclass(slots=True)
class Chunk:
    """One read: ``nbytes`` at file offset ``offset`` into byte ``into`` of its batch's buffer."""

    batch: int
    offset: int
    nbytes: int
    into: int
    last_of_batch: bool


def read_header(path: Path) -> list[TensorEntry]:
    """A shard's tensors with absolute file offsets, in file order; ``WeightLoadError`` if malformed."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise WeightLoadError(f"{path} is not a safetensors file (shorter than its header length)")
        (size,) = struct.unpack("<Q", head)
        try:
            header = json.loads(f.read(size))
        except (ValueError, UnicodeDecodeError) as exc:
            raise WeightLoadError(f"{path}: unreadable safetensors header ({exc})") from None
    data_start, file_size = 8 + size, path.stat().st_size
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise WeightLoadError(f"{path}: tensor {name} has dtype {info.get('dtype')!r}, which this torch lacks")
        begin, end = (data_start + int(o) for o in info["data_offsets"])
        shape = tuple(int(d) for d in info["shape"])
        numel = 1
        for d in shape:
            numel *= d
        if end - begin != numel * dtype.itemsize or end > file_size:
            raise WeightLoadError(f"{path}: tensor {name} of shape {shape} ({info['dtype']}) does not fit "
                                  f"bytes {begin}..{end} of a {file_size}-byte file")
        entries.append(TensorEntry(name, dtype, shape, begin, end))
    return sorted(entries, key=lambda e: e.begin)


def plan_reads(headers: list[list[TensorEntry]], batch_bytes: int, chunk_bytes: int) -> tuple[list[Batch], list[Chunk]]:
    """Batches of consecutive tensors (up to ``batch_bytes`` each, or one bigger tensor) and their chunks."""
    batches: list[Batch] = []
    for shard, entries in enumerate(headers):
        current: list[TensorEntry] = []
        for e in entries:
            if current and (e.end - current[0].begin > batch_bytes or e.begin != current[-1].end):
                batches.append(Batch(shard, current[0].begin, current[-1].end, current))
                current = []
            current.append(e)
        if current:
            batches.append(Batch(shard, current[0].begin, current[-1].end, current))
    chunks = []
    for i, b in enumerate(batches):
        starts = list(range(b.begin, b.end, chunk_bytes)) or [b.begin]  # an all-empty batch still ends
        for s in starts:
            n = min(chunk_bytes, b.end - s)
            chunks.append(Chunk(i, s, n, s - b.begin, s == starts[-1]))
    return batches, chunks


def _read_exact(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise WeightLoadError(f"short read at byte {offset + done} (file truncated?)")
        done += n


def _tensors_of(batch: Batch, buffer: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    for e in batch.entries:
        if e.end == e.begin:
            yield e.name, torch.empty(e.shape, dtype=e.dtype, device=buffer.device)
            continue
        raw = buffer[e.begin - batch.begin: e.end - batch.begin]
        if (e.begin - batch.begin) % e.dtype.itemsize:
            raw = raw.clone()  # a writer that did not align this tensor: viewing needs aligned bytes
        yield e.name, raw.view(e.dtype).reshape(e.shape)


class _Progress:
    """A tqdm bar in bytes on a terminal, else one log line per shard (bytes, GB/s)."""

    def __init__(self, shards: list[Path], sizes: list[int], show: bool) -> None:
        self.shards, self.sizes = shards, sizes
        self.start = self.shard_start = time.perf_counter()
        self.bar = None
        if show and sys.stderr.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self.bar = tqdm(total=sum(sizes), desc="Loading safetensors", unit="B", unit_scale=True)
        self.log_shards = show and self.bar is None

    def advance(self, nbytes: int) -> None:
        if self.bar is not None:
            self.bar.update(nbytes)

    def shard_done(self, shard: int) -> None:
        now = time.perf_counter()
        if self.log_shards:
            took = max(now - self.shard_start, 1e-9)
            log.info("weights: shard %d/%d %s: %.2f GB in %.2f s (%.2f GB/s)", shard + 1, len(self.shards),
                     self.shards[shard].name, self.sizes[shard] / 1e9, took, self.sizes[shard] / 1e9 / took)
        self.shard_start = now

    def close(self, finished: bool) -> None:
        """Close the bar; a finished load logs its total."""
        if self.bar is not None:
            self.bar.close()
        if not finished:
            return
        took = time.perf_counter() - self.start
        total = sum(self.sizes)
        log.info("weights: %.2f GB from %d shard(s) in %.2f s (%.2f GB/s)", total / 1e9, len(self.shards), took,
                 total / 1e9 / max(took, 1e-9))


def stream_safetensors(shards: list[Path], device: torch.device | str = "cpu", progress: bool = True,
                       batch_bytes: int = 512 * MiB, chunk_bytes: int = 64 * MiB, num_slots: int = 8,
                       num_readers: int = 4, staged: bool | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor on device)`` for every tensor of ``shards``, in file order.

    ``staged`` (default: on CUDA) reads through the pinned slots and copies to the device; off,
    chunks are read straight into CPU batch buffers. Tests force it on the CPU to run its path.
    """
    device = torch.device(device)
    staged = device.type == "cuda" if staged is None else staged
    headers = [read_header(Path(s)) for s in shards]
    batches, chunks = plan_reads(headers, batch_bytes, chunk_bytes)
    sizes = [sum(e.end - e.begin for e in h) for h in headers]
    slot_bytes = min(chunk_bytes, max((c.nbytes for c in chunks), default=1))
    pin = staged and device.type == "cuda"
    slots = torch.empty(num_slots, max(1, slot_bytes), dtype=torch.uint8, pin_memory=pin) if staged else None
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
    buffers: dict[int, torch.Tensor] = {}  # batch -> its buffer, while its chunks are read
    bar = _Progress([Path(s) for s in shards], sizes, progress)
    pool = ThreadPoolExecutor(max_workers=num_readers, thread_name_prefix="armillary-weights")

    def buffer_of(batch: int) -> torch.Tensor:
        if batch not in buffers:
            b = batches[batch]
            buffers[batch] = torch.empty(b.end - b.begin, dtype=torch.uint8, device=device if staged else "cpu")
        return buffers[batch]

    def target_of(j: int) -> torch.Tensor:
        """Where chunk ``j`` is read to: its staging slot, or (unstaged) its bytes of the batch buffer."""
        c = chunks[j]
        return slots[j % num_slots, :c.nbytes] if staged else buffer_of(c.batch)[c.into: c.into + c.nbytes]

    def read(j: int, target: torch.Tensor, after: torch.cuda.Event | None) -> None:
        if after is not None:
            after.synchronize()  # the slot's previous chunk has reached the device
        c = chunks[j]
        _read_exact(fds[batches[c.batch].shard], memoryview(target.numpy()), c.offset)

    window: deque[Future] = deque()
    fds: list[int] = []
    finished = False
    try:
        for shard in shards:
            fds.append(os.open(shard, os.O_RDONLY))
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fds[-1], 0, 0, os.POSIX_FADV_SEQUENTIAL)  # a larger read-ahead
        for j in range(min(num_slots, len(chunks))):
            window.append(pool.submit(read, j, target_of(j), None))
        for j, c in enumerate(chunks):
            window.popleft().result()
            after = None
            if staged:
                dest = buffer_of(c.batch)[c.into: c.into + c.nbytes]
                dest.copy_(slots[j % num_slots, :c.nbytes], non_blocking=pin)
                if stream is not None:
                    after = torch.cuda.Event()
                    after.record(stream)
            nxt = j + num_slots
            if nxt < len(chunks):
                window.append(pool.submit(read, nxt, target_of(nxt), after))
            bar.advance(c.nbytes)
            if c.last_of_batch:
                batch = batches[c.batch]
                yield from _tensors_of(batch, buffers.pop(c.batch))
                if c.batch + 1 == len(batches) or batches[c.batch + 1].shard != batch.shard:
                    bar.shard_done(batch.shard)
        finished = True
    finally:
        for f in window:
            f.cancel()
        pool.shutdown(wait=True)
        for fd in fds:
            os.close(fd)
        bar.close(finished)
