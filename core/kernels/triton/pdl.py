"""Programmatic dependent launch (sm_90+): a kernel launched with it may start while the kernel before
it is still running, and must ``gdc_wait`` before reading anything that kernel (or an earlier one) wrote.

Decode steps are chains of ~350 small kernels; overlapping each launch with its predecessor's tail
hides most of the per-launch latency inside the CUDA graph. Kernels opt in with a ``PDL`` constexpr:
``pdl_prologue`` at their top (let the next kernel launch early, then wait for the previous one),
and their wrappers pass ``**launch_options(device)``. Whether it pays depends on the model's kernel chain
(GLM-4.7-Flash decode gains 5%, Gemma 4 loses 7%), so the tuning tables decide per served architecture
(``"pdl": {"gemma4": {"enabled": false}}`` in a plugin's table, keyed by the registry name, or ``"default"``
for all its models); ``ARMILLARY_PDL=0`` / ``=1`` overrides them. Bigger decode batches can lose what small ones
gain (FP8 Qwen3.6 at 64 streams ran 1.8% faster without it): an entry's ``max_batch`` captures the decode graphs
of more sequences without PDL (``graph_batch`` tells the launches which graph they are in).

While a PDL kernel waits for the one before, the weights it will read cannot change: kernels with a ``PREFETCH``
constexpr ask L2 for their weight tile first (``prefetch_rows_l2``), then wait, so the tile streams in during the
previous kernel's tail. A hint only (L2 is coherent: a prefetched line is never stale); on where ``l2_prefetch``
says (``ARMILLARY_L2_PREFETCH=0`` / ``=1``, else the tables' ``l2_prefetch`` entry, default off; one kind of
``PREFETCH_KINDS`` can be turned off alone) and PDL is on.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

import torch
import triton
import triton.language as tl

from armillary.kernels import tuning
from armillary.kernels.tuning import active_architecture, kernel_config

try:  # Triton >= 3.3
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: PDL stays off
    gdc_launch_dependents = gdc_wait = None


@lru_cache(maxsize=None)
def _supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_override(value: str | None = None) -> bool | None:
    """``ARMILLARY_PDL`` (or ``value``): "0" forces PDL off, "1" on (where the GPU has it); unset, the tables decide."""
    value = os.environ.get("ARMILLARY_PDL", "") if value is None else value
    if value not in ("", "0", "1"):
        raise ValueError(f"ARMILLARY_PDL must be 0 or 1, not {value!r}")
    return None if value == "" else value == "1"


def pdl_available(device: torch.device) -> bool:
    """A CUDA device of compute capability 9+ and a Triton that has the intrinsics."""
    if device.type != "cuda" or gdc_wait is None:
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())


_DECIDED: dict[tuple, bool] = {}  # every launch asks (an eager prefill ~1,400 times): one answer per setting
_graph_batch: int | None = None  # sequences of the decode graph being warmed up or captured; None: any other launch


@contextmanager
def graph_batch(num_seqs: int) -> Iterator[None]:
    """Launches inside belong to the decode graph of ``num_seqs`` sequences (its warm-up and its capture)."""
    global _graph_batch
    saved, _graph_batch = _graph_batch, num_seqs
    try:
        yield
    finally:
        _graph_batch = saved


def pdl_enabled(device: torch.device) -> bool:
    """Available, and asked for by ``ARMILLARY_PDL`` or else the tables' ``pdl`` entry (default on; off inside
    decode graphs of more than its ``max_batch`` sequences)."""
    env = os.environ.get("ARMILLARY_PDL", "")
    key = (device, env, active_architecture(), tuning.active_packages(), tuning.load_table, pdl_available,
           _graph_batch)
    decided = _DECIDED.get(key)
    if decided is None:
        decided = _DECIDED[key] = _decide(device, env)
    return decided


def _decide(device: torch.device, env: str) -> bool:
    if not pdl_available(device):
        return False
    forced = pdl_override(env)
    if forced is not None:
        return forced
    table_key = active_architecture() or "default"
    entry = kernel_config("armillary.kernels", "pdl", table_key, {"enabled": True, "max_batch": None}, device)
    too_big = entry["max_batch"] is not None and _graph_batch is not None and _graph_batch > entry["max_batch"]
    return bool(entry["enabled"]) and not too_big


PREFETCH_KINDS = ("weights", "experts", "state")  # skinny GEMV tiles, chosen MoE experts, recurrent state rows


def l2_prefetch(device: torch.device, kind: str = "weights") -> bool:
    """PDL on, and ``ARMILLARY_L2_PREFETCH`` or else the tables' ``l2_prefetch`` entry (per served architecture,
    or "default") asks for prefetches before the wait (default off); the entry may turn one ``kind`` of
    ``PREFETCH_KINDS`` off (``{"enabled": true, "experts": false}``), for A/B runs of one kind."""
    return pdl_enabled(device) and _prefetch_asked(device, kind)


def _prefetch_asked(device: torch.device, kind: str) -> bool:
    """``l2_prefetch`` without its PDL half (``launch_options`` has asked that already)."""
    if kind not in PREFETCH_KINDS:
        raise ValueError(f"l2_prefetch: kind {kind!r} is not one of {PREFETCH_KINDS}")
    env = os.environ.get("ARMILLARY_L2_PREFETCH", "")
    key = ("l2_prefetch", kind, device, env, active_architecture(), tuning.active_packages(), tuning.load_table)
    decided = _DECIDED.get(key)
    if decided is None:
        entry = kernel_config("armillary.kernels", "l2_prefetch", active_architecture() or "default",
                              {"enabled": False, **dict.fromkeys(PREFETCH_KINDS, True)}, device)
        forced = pdl_override(env)
        decided = _DECIDED[key] = bool(entry["enabled"] if forced is None else forced) and bool(entry[kind])
    return decided


_ON, _OFF = {"PDL": True, "launch_pdl": True}, {"PDL": False}
_ON_PREFETCH = {"PDL": True, "launch_pdl": True, "PREFETCH": True}
_ON_NO_PREFETCH, _OFF_NO_PREFETCH = {**_ON, "PREFETCH": False}, {**_OFF, "PREFETCH": False}


def launch_options(device: torch.device, prefetch: str | None = None) -> dict:
    """Extra launch keywords for a kernel with a ``PDL`` constexpr: ``PDL`` itself and ``launch_pdl``;
    ``prefetch`` (a kind of ``PREFETCH_KINDS``): the kernel has a ``PREFETCH`` constexpr too (``l2_prefetch``'s
    answer for that kind).

    One shared dict per answer: callers unpack it (``**launch_options(device)``), never change it."""
    if prefetch is None:
        return _ON if pdl_enabled(device) else _OFF
    if not pdl_enabled(device):
        return _OFF_NO_PREFETCH
    return _ON_PREFETCH if _prefetch_asked(device, prefetch) else _ON_NO_PREFETCH


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    """First statement of a PDL kernel: the next kernel may launch now; then wait for the previous one."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def pdl_launch_dependents(PDL: tl.constexpr):
    """``pdl_prologue``'s first half: the next kernel may launch now (work that reads nothing written before may
    follow, e.g. ``prefetch_rows_l2``)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """``pdl_prologue``'s second half: wait until the previous kernel has finished and its writes are visible."""
    if PDL:
        gdc_wait()


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the 128-byte line at each of ``ptrs`` (in bounds); nothing waits for it, nothing is returned."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def prefetch_rows_l2(ptr, rows, stride, k_lo, k_hi, BLOCK_K: tl.constexpr):
    """L2 prefetches of a weight tile: rows ``rows`` ([R], in bounds) of a row-major matrix, columns [k_lo, k_hi)
    (at least one), one 128-byte line at a time, ``BLOCK_K`` columns (a power of two) an iteration."""
    ELEM_BYTES: tl.constexpr = ptr.dtype.element_ty.primitive_bitwidth // 8
    LINES: tl.constexpr = (BLOCK_K * ELEM_BYTES + 127) // 128
    STEP: tl.constexpr = BLOCK_K // LINES  # a line's columns, or the whole BLOCK_K when that is less
    row_ptrs = ptr + rows[:, None].to(tl.int64) * stride  # [R, 1]
    for k0 in range(k_lo, k_hi, BLOCK_K):
        cols = tl.minimum(k0 + tl.arange(0, LINES) * STEP, k_hi - 1)  # [LINES]; clamped: never past the row
        prefetch_l2(row_ptrs + cols[None, :])


EXPERT_PREFETCH_BYTES = 32 << 20  # the chosen experts' up and down weights at most: under an H100 / H200's 50 MB L2
EXPERT_PREFETCH_CHUNKS = 8  # bulk prefetches an expert matrix is cut into (one a program, the first programs)


def expert_prefetch_chunk(prefetch: bool, pairs: int, weights: tuple[torch.Tensor, ...]) -> int:
    """Bytes of one bulk L2 prefetch (a multiple of 16) when the MoE up GEMV's first programs are to ask L2 for
    the chosen experts' ``weights`` ([E, ...] each, contiguous per expert), or 0: ``prefetch`` off
    (``launch_options``' answer), or the pairs' weights over ``EXPERT_PREFETCH_BYTES``."""
    per_pair = sum(w[0].numel() * w.element_size() for w in weights)
    if not prefetch or pairs * per_pair > EXPERT_PREFETCH_BYTES:
        return 0
    if any((w[0].numel() * w.element_size()) % 16 or (w.stride(0) * w.element_size()) % 16
           or w.data_ptr() % 16 for w in weights):
        return 0  # a bulk prefetch takes 16-byte aligned addresses and sizes only
    largest = max(w[0].numel() * w.element_size() for w in weights)
    return -(-largest // (16 * EXPERT_PREFETCH_CHUNKS)) * 16


def expert_prefetch_args(w13: torch.Tensor, w2: torch.Tensor, chunk: int) -> dict:
    """The MoE up GEMV's prefetch arguments: byte strides and sizes of one expert's w13 and w2 slices, the chunk
    (``expert_prefetch_chunk``'s; 0: off)."""
    return dict(expert_stride_w13=w13.stride(0) * w13.element_size(), expert_stride_w2=w2.stride(0) * w2.element_size(),
                bytes_w13=w13[0].numel() * w13.element_size(), bytes_w2=w2[0].numel() * w2.element_size(),
                chunk_bytes=max(chunk, 16), PREFETCH_EXPERTS=chunk > 0)


@triton.jit
def prefetch_bulk_l2(ptr, nbytes):
    """One thread of the program asks L2 for ``nbytes`` (a multiple of 16) from ``ptr`` (16-byte aligned) in one
    ``cp.async.bulk.prefetch`` (sm_90+); a hint, nothing waits for it."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptr, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_expert_chunk_l2(w_ptr, e, expert_stride_bytes, expert_bytes, chunk, chunk_bytes):
    """Chunk ``chunk`` (of ``chunk_bytes``) of expert ``e``'s slice of an expert-major weight, into L2; chunks past
    the slice's ``expert_bytes`` ask for nothing."""
    start = chunk * chunk_bytes
    if start < expert_bytes:
        base = w_ptr.to(tl.pointer_type(tl.int8)) + e * expert_stride_bytes + start
        prefetch_bulk_l2(base, tl.minimum(chunk_bytes, expert_bytes - start))
