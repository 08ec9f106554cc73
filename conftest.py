"""Suite-wide settings: Triton's interpreter without a GPU, one intra-op thread for tiny tensors, no engine warm-up."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # the interpreter is chosen when a kernel is defined, so it must be set before any test imports one
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True, scope="session")
def _no_engine_warmup():
    # start-up warm-up costs a tiny engine ~8x its build time; tests/test_warmup.py puts it back
    import armillary.engine

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(armillary.engine, "warm_up", lambda engine: None)
        yield


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    # on a 2-core box, OpenMP waits dominate tiny ops
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
