"""The checked timing of one decode-GEMV launch config that the skinny sweeps share (fp8_skinny_sweep, fp4_skinny_sweep): µs per call in a CUDA graph, error, bit-stability across calls and graph replays, split-K tickets back at 0."""
from __future__ import annotations

from typing import Callable

import torch

from skinny_gemm import rel_err, tickets_clear, time_calls


def checked_timing(call: Callable[[int], torch.Tensor], copies: int, want: torch.Tensor, tol: float,
                   gbps: Callable[[float], float]) -> dict:
    """``call(i)`` runs the config on weight copy i; ``want`` is copy 0's fp32 product. ``ok``: it may count
    (bit-stable, tickets clear, error within ``tol``); a config that fails to compile or launch reports why."""
    row: dict = {}
    try:
        eager = call(0)
        again = call(0)
        us, outs = time_calls(call, copies)
        same = all(torch.equal(eager, o) for o in [again, *outs[::copies]])  # calls and graph replays
        row.update(us=us, GBps=gbps(us), err=rel_err(eager, want), stable=bool(same), tickets_clear=tickets_clear())
        row["ok"] = row["stable"] and row["tickets_clear"] and row["err"] <= tol
    except Exception as e:  # a config that does not compile or fit: report it, keep going
        row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
    return row
