"""Per-device kernel scratch: cached by name, grown by doubling, replaced buffers kept alive."""
from __future__ import annotations

import torch

from armillary.kernels.triton import device_buffers as db


def test_buffers_are_cached_grown_and_retired():
    cpu = torch.device("cpu")
    first = db.device_buffer("test-scratch", cpu, 10, torch.float32, zeroed=True)
    assert first.numel() >= 10 and not first.any()
    assert db.device_buffer("test-scratch", cpu, 5, torch.float32, zeroed=True) is first  # big enough: reused
    other = db.device_buffer("test-other", cpu, 5, torch.float32, zeroed=False)
    assert other.data_ptr() != first.data_ptr()  # names do not share memory
    grown = db.device_buffer("test-scratch", cpu, first.numel() + 1, torch.float32, zeroed=True)
    assert grown.numel() >= 2 * first.numel() and not grown.any()
    assert any(t is first for t in db._RETIRED)  # graphs captured with the old buffer keep valid memory


def test_tickets_are_int32_zeros_of_at_least_the_minimum():
    tickets = db.ticket_buffer(torch.device("cpu"), 3)
    assert tickets.dtype == torch.int32 and tickets.numel() >= db.MIN_TICKETS and not tickets.any()
