"""Integer helpers for launch wrappers (host code): grids and padded block sizes.

Triton 3.6's ``triton.cdiv`` / ``triton.next_power_of_2`` are constexpr functions whose host calls cost
1.1-2.5 µs each on the H200 machines (``bench/launch_overhead.py``); an eager prefill makes ~1,300 of them.
Inside ``@triton.jit`` bodies keep ``tl.cdiv`` / ``triton.next_power_of_2``.
"""
from __future__ import annotations


def cdiv(x: int, y: int) -> int:
    """ceil(x / y) for positive y."""
    return -(-x // y)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n, and 0 for n = 0 (as ``triton.next_power_of_2``)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()
