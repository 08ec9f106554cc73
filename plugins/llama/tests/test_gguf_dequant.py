"""The vectorised GGUF dequantization equals the gguf package's, bit for bit, on random blocks."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T

from armillary_llama.gguf_dequant import dequantize_fast

FAST = [T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]


def _random_tensor(qtype: T, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random bytes of a ``[rows, cols]`` tensor; block scales drawn as finite f16 in [-1, 1]."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    if qtype == T.F16:
        return rng.uniform(-4, 4, rows * cols).astype(np.float16).view(np.uint8)
    if qtype == T.BF16:
        return (rng.uniform(-4, 4, rows * cols).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    raw = rng.integers(0, 256, rows * cols // block * size, dtype=np.uint8).reshape(-1, size)
    scales = 2 if qtype in (T.Q4_1, T.Q5_1) else 1  # d (and m) lead every block
    raw[:, : 2 * scales] = rng.uniform(-1, 1, (raw.shape[0], scales)).astype(np.float16).view(np.uint8)
    return raw.reshape(-1)


@pytest.mark.parametrize("qtype", FAST, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,cols", [(1, 32), (7, 96), (3, 4096)])
def test_fast_dequantize_equals_gguf(qtype, rows, cols):
    raw = _random_tensor(qtype, rows, cols, seed=rows * cols)
    ref = quants.dequantize(raw.reshape(rows, -1), qtype).reshape(-1)
    got = dequantize_fast(raw, qtype)
    assert got.dtype == np.float32 and np.array_equal(got, ref)


def test_other_types_are_left_to_the_gguf_package():
    assert dequantize_fast(np.zeros(GGML_QUANT_SIZES[T.Q4_K][1], np.uint8), T.Q4_K) is None
