"""fp32 -> e4m3 rounding in Triton that is exact to torch's cast (round to nearest even, saturated at ±448).

The magnitude is first rounded onto the e4m3 grid in fp32 (the grid step is 2^(e - 3) for exponent e,
2^-9 below the normal range), so the final cast only converts a representable value: the
interpreter's own fp32 -> fp8 cast drops the carry when rounding crosses a power of two (124.3 ->
64), and the GPU's cast then has nothing left to round. Every step is exact in fp32: scaling by
powers of two is a multiply by an exact reciprocal (Triton's ``/`` on fp32 is ``div.full.f32``
on the GPU, up to 2 ulp off), and divisions by a scale go through ``div_rn`` (IEEE, as torch).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def to_e4m3(x):
    """x (fp32) -> float8e4nv, RTNE, saturated to ±448, the sign bit copied from x (-0 stays -0; NaN undefined)."""
    a = tl.minimum(tl.abs(x), 448.0)
    exp = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # unbiased exponent of |x|
    step_exp = tl.maximum(exp, -6) - 3  # 3 mantissa bits; subnormals share 2^-9
    step = ((step_exp + 127) << 23).to(tl.float32, bitcast=True)
    inv_step = ((127 - step_exp) << 23).to(tl.float32, bitcast=True)  # 2^-step_exp exactly
    r = ((a * inv_step + 8388608.0) - 8388608.0) * step  # round |x| / step to an integer, ties to even
    r = tl.minimum(r, 448.0)
    # the sign as a bit, not ``-r``: Triton 3.6 negates as ``0 - r``, so a negative value that rounds to
    # zero came out +0 (0x00) where torch stores -0 (0x80): the 1772 bytes the GPU check saw
    sign = x.to(tl.uint32, bitcast=True) & 0x80000000
    return (r.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True).to(tl.float8e4nv)


@triton.jit
def exact_div(x, y):
    """x / y rounded as IEEE (and torch) round it; Triton's ``/`` is approximate on the GPU."""
    return tl.math.div_rn(x, y)


@triton.jit
def cache_value(x, scale_ptr, dtype: tl.constexpr, SCALED: tl.constexpr):
    """A K / V value as its cache stores it: ``x / scale`` in e4m3 for a scaled (fp8) cache, else cast."""
    if SCALED:
        s = tl.load(scale_ptr)
        return to_e4m3(exact_div(x.to(tl.float32), s + tl.zeros_like(x.to(tl.float32))))
    return x.to(dtype)
