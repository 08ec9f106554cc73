"""Read a GGUF file's header (metadata + tensor table) and locate each tensor's bytes, checking as it goes.

We parse the header ourselves rather than through ``gguf.GGUFReader`` so that a truncated or
corrupt file fails with a message naming the key or tensor being read, its type, and the byte
offsets involved. Tensor bytes are memory-mapped; nothing is copied until a tensor is asked for.

Layout (GGUF v2/v3, little-endian): magic ``GGUF``, u32 version, u64 tensor count, u64 metadata
count; metadata ``(string key, u32 value type, value)``; tensor infos ``(string name, u32 n_dims,
u64 dims[n_dims], u32 ggml type, u64 offset)``; padding to ``general.alignment`` (default 32); data.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from armillary.errors import WeightLoadError

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# struct format of each fixed-size value type
_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.FLOAT64: "<d", GGUFValueType.BOOL: "<?",
}
_NUMPY_DTYPES = {
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2", GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4", GGUFValueType.UINT64: "<u8", GGUFValueType.INT64: "<i8",
    GGUFValueType.FLOAT32: "<f4", GGUFValueType.FLOAT64: "<f8", GGUFValueType.BOOL: "?",
}
_MAX_DIMS = 4  # ggml tensors have at most 4 dimensions


class GGUFError(WeightLoadError):
    """The GGUF file is truncated, corrupt, or uses something armillary-llama does not serve."""


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor of the file. ``shape`` is in torch order (outermost first), the reverse of GGUF's dims."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return ggml_type_name(self.ggml_type)

    def describe(self) -> str:
        return f"tensor {self.name!r} ({self.type_name}, shape {list(self.shape)})"


def ggml_type_name(ggml_type: int) -> str:
    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"unknown ggml type id {ggml_type}"


class _Cursor:
    """Bounds-checked little-endian reads over the mapped file; ``what`` names the field for errors."""

    def __init__(self, buffer: mmap.mmap, path: Path) -> None:
        self.buffer = buffer
        self.size = len(buffer)
        self.path = path
        self.pos = 0

    def fail(self, message: str) -> GGUFError:
        return GGUFError(f"corrupt GGUF file {str(self.path)!r}: {message}")

    def take(self, n: int, what: str) -> int:
        """Advance over ``n`` bytes; returns where they start."""
        if n < 0 or self.pos + n > self.size:
            raise GGUFError(
                f"GGUF file {str(self.path)!r} is truncated or corrupt: reading {what} needs bytes "
                f"{self.pos}..{self.pos + n} but the file has {self.size} bytes")
        start = self.pos
        self.pos += n
        return start

    def scalar(self, value_type: GGUFValueType, what: str) -> Any:
        fmt = _SCALAR_FORMATS[value_type]
        start = self.take(struct.calcsize(fmt), what)
        return struct.unpack_from(fmt, self.buffer, start)[0]

    def string(self, what: str) -> str:
        length = self.scalar(GGUFValueType.UINT64, f"the length of {what}")
        start = self.take(length, what)
        try:
            return bytes(self.buffer[start:start + length]).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(f"{what} at byte {start} is not UTF-8 ({exc.reason})") from None

    def value(self, value_type: int, what: str) -> Any:
        try:
            kind = GGUFValueType(value_type)
        except ValueError:
            raise self.fail(f"{what} has unknown value type {value_type} (byte {self.pos - 4})") from None
        if kind == GGUFValueType.STRING:
            return self.string(what)
        if kind == GGUFValueType.ARRAY:
            return self.array(what)
        return self.scalar(kind, what)

    def array(self, what: str) -> list[Any]:
        item_type = self.scalar(GGUFValueType.UINT32, f"the item type of {what}")
        count = self.scalar(GGUFValueType.UINT64, f"the length of {what}")
        remaining = self.size - self.pos
        if count > remaining:  # every item takes at least one byte: a larger count is corrupt
            raise GGUFError(f"GGUF file {str(self.path)!r} is truncated or corrupt: {what} claims {count} items "
                            f"but only {remaining} bytes remain")
        if item_type in _NUMPY_DTYPES:
            dtype = np.dtype(_NUMPY_DTYPES[GGUFValueType(item_type)])
            start = self.take(count * dtype.itemsize, what)
            return np.frombuffer(self.buffer, dtype=dtype, count=count, offset=start).tolist()
        if item_type == GGUFValueType.STRING:
            return self.strings(count, what)
        return [self.value(item_type, f"item {i} of {what}") for i in range(count)]

    def strings(self, count: int, what: str) -> list[str]:
        """``count`` strings in a row (a tokenizer's vocabulary, merges): one tight loop, no per-item
        formatting; errors name the item as ``string`` does."""
        buf, pos, size, out = self.buffer, self.pos, self.size, []
        length_of = struct.Struct(_SCALAR_FORMATS[GGUFValueType.UINT64]).unpack_from
        for i in range(count):
            if pos + 8 > size:
                self.pos = pos
                self.take(8, f"the length of item {i} of {what}")  # raises: truncated
            n = length_of(buf, pos)[0]
            if pos + 8 + n > size:
                self.pos = pos + 8
                self.take(n, f"item {i} of {what}")  # raises: truncated
            try:
                out.append(str(buf[pos + 8:pos + 8 + n], "utf-8"))
            except UnicodeDecodeError as exc:
                self.pos = pos + 8 + n
                raise self.fail(f"item {i} of {what} at byte {pos + 8} is not UTF-8 ({exc.reason})") from None
            pos += 8 + n
        self.pos = pos
        return out


@dataclass(slots=True)
class GGUFFile:
    """The parsed header of one GGUF file and a read-only map of its bytes."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    _buffer: mmap.mmap

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"GGUF file {str(self.path)!r} has no general.architecture key")
        return arch

    def raw(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view ``[nbytes]`` (checked to lie inside the file)."""
        return np.frombuffer(self._buffer, dtype=np.uint8, count=info.nbytes, offset=info.offset)


def tensor_nbytes(name: str, dims: list[int], ggml_type: int, path: Path) -> int:
    """Bytes a tensor of GGUF ``dims`` (innermost first) and ``ggml_type`` occupies."""
    try:
        block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise GGUFError(f"corrupt GGUF file {str(path)!r}: tensor {name!r} has {ggml_type_name(ggml_type)}") from None
    if dims[0] % block_size:
        raise GGUFError(f"corrupt GGUF file {str(path)!r}: tensor {name!r} ({ggml_type_name(ggml_type)}) has rows "
                        f"of {dims[0]} values, not a multiple of its block size {block_size}")
    return int(np.prod(dims, dtype=np.int64)) // block_size * type_size


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse the header and check every tensor lies within the file; raises ``GGUFError`` otherwise."""
    path = Path(path)
    with open(path, "rb") as f:
        if path.stat().st_size == 0:
            raise GGUFError(f"GGUF file {str(path)!r} is empty")
        buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cur = _Cursor(buffer, path)
    if bytes(buffer[:4]) != MAGIC:
        raise GGUFError(f"{str(path)!r} is not a GGUF file: it starts with {bytes(buffer[:4])!r}, not {MAGIC!r}")
    cur.take(4, "the magic")
    version = cur.scalar(GGUFValueType.UINT32, "the format version")
    if version not in SUPPORTED_VERSIONS:
        hint = " (a big-endian file?)" if version > 0xFFFF else ""
        raise GGUFError(f"GGUF file {str(path)!r} has format version {version}{hint}; "
                        f"armillary-llama reads versions {list(SUPPORTED_VERSIONS)}")
    n_tensors = cur.scalar(GGUFValueType.UINT64, "the tensor count")
    n_keys = cur.scalar(GGUFValueType.UINT64, "the metadata count")
    if n_tensors > cur.size or n_keys > cur.size:
        raise cur.fail(f"header claims {n_tensors} tensors and {n_keys} metadata keys in a {cur.size}-byte file")

    metadata: dict[str, Any] = {}
    for i in range(n_keys):
        key = cur.string(f"the name of metadata key #{i}")
        value_type = cur.scalar(GGUFValueType.UINT32, f"the value type of key {key!r}")
        metadata[key] = cur.value(value_type, f"the value of key {key!r}")

    raw_infos = []
    for i in range(n_tensors):
        name = cur.string(f"the name of tensor #{i}")
        n_dims = cur.scalar(GGUFValueType.UINT32, f"the dimension count of tensor {name!r}")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise cur.fail(f"tensor {name!r} claims {n_dims} dimensions")
        dims = [cur.scalar(GGUFValueType.UINT64, f"dimension {d} of tensor {name!r}") for d in range(n_dims)]
        ggml_type = cur.scalar(GGUFValueType.UINT32, f"the type of tensor {name!r}")
        offset = cur.scalar(GGUFValueType.UINT64, f"the data offset of tensor {name!r}")
        raw_infos.append((name, dims, ggml_type, offset))

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise cur.fail(f"general.alignment is {alignment!r}, not a power of two")
    data_start = -(-cur.pos // alignment) * alignment

    tensors: dict[str, TensorInfo] = {}
    for name, dims, ggml_type, offset in raw_infos:  # the whole table is checked before any extent
        if name in tensors:
            raise cur.fail(f"tensor {name!r} appears twice in the tensor table")
        nbytes = tensor_nbytes(name, dims, ggml_type, path)
        tensors[name] = TensorInfo(name, tuple(int(d) for d in reversed(dims)), ggml_type, data_start + offset, nbytes)
        if offset % alignment:
            raise cur.fail(f"{tensors[name].describe()} starts at data offset {offset}, not a multiple of {alignment}")
    for info in tensors.values():
        if info.offset + info.nbytes > cur.size:
            raise GGUFError(
                f"GGUF file {str(path)!r} is truncated: {info.describe()} needs bytes {info.offset}.."
                f"{info.offset + info.nbytes} but the file ends at byte {cur.size}")
    return GGUFFile(path, version, metadata, tensors, buffer)


def peek_architecture(path: str | Path) -> str | None:
    """``general.architecture`` read from the first metadata keys (cheap); None when unreadable."""
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
    except OSError:
        return None
    if head[:4] != MAGIC or len(head) < 24:
        return None
    pos = 24  # magic, version, tensor count, key count
    for _ in range(min(8, struct.unpack_from("<Q", head, 16)[0])):
        if pos + 8 > len(head):
            return None
        (length,) = struct.unpack_from("<Q", head, pos)
        key = head[pos + 8:pos + 8 + length]
        pos += 8 + length
        if pos + 4 > len(head):
            return None
        (value_type,) = struct.unpack_from("<I", head, pos)
        pos += 4
        if value_type != GGUFValueType.STRING:
            fmt = _SCALAR_FORMATS.get(GGUFValueType(value_type)) if value_type in _SCALAR_FORMATS else None
            if fmt is None:
                return None  # arrays before the architecture key: give up, the full reader will tell
            pos += struct.calcsize(fmt)
            continue
        if pos + 8 > len(head):
            return None
        (vlen,) = struct.unpack_from("<Q", head, pos)
        value = head[pos + 8:pos + 8 + vlen]
        pos += 8 + vlen
        if key == b"general.architecture":
            return value.decode("utf-8", errors="replace")
    return None
