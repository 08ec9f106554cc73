"""Triton varlen causal conv1d (prefill) against ``armillary.kernels.conv1d.causal_conv1d_varlen``.

Runs on CPU under the Triton interpreter (tiny, odd sizes); on a CUDA machine the same tests run the
compiled kernel.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from armillary.kernels.conv1d import causal_conv1d_varlen  # noqa: E402
from armillary.kernels.triton.causal_conv1d import causal_conv1d_prefill  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
SMALL_TILES = {"BLOCK_T": 16, "BLOCK_C": 32}  # several token blocks per sequence and channel blocks


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all()
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _offsets(lengths: list[int]) -> list[int]:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_bias,activation,config", [
    (False, "silu", SMALL_TILES),
    (True, "silu", SMALL_TILES),
    (True, None, None),
])
def test_matches_reference_on_strided_varlen_input(dtype, with_bias, activation, config):
    gen = torch.Generator().manual_seed(1)
    lengths, channels, kernel = [1, 5, 63, 70, 0, 2], 37, 4
    total = sum(lengths)
    wide = torch.randn(total, channels + 11, generator=gen).to(dtype)
    x = wide[:, 3 : 3 + channels]  # a column slice, as the q‖k‖v part of an in_proj output
    weight = (torch.randn(channels, kernel, generator=gen) * 0.5).to(dtype)
    bias = torch.randn(channels, generator=gen).to(dtype) if with_bias else None
    states = torch.randn(8, channels, kernel - 1, generator=gen).to(dtype)
    slots = torch.tensor([5, 0, 3, 2, 7, 1])
    cu = _offsets(lengths)

    ref_states = states.clone()
    ref = causal_conv1d_varlen(x, weight, bias, ref_states, slots, cu, activation=activation)
    dev = lambda t: t.to(DEVICE) if t is not None else None  # noqa: E731
    got_states = dev(states)
    got = causal_conv1d_prefill(
        dev(wide)[:, 3 : 3 + channels], dev(weight), dev(bias), got_states, dev(slots),
        torch.tensor(cu, dtype=torch.int32, device=DEVICE), activation=activation, config=config,
    )
    assert got.shape == ref.shape and got.dtype == dtype
    assert _rel_err(got.cpu(), ref) < TOL[dtype]
    # new windows: exact copies of inputs (or of the old window for the short sequences)
    torch.testing.assert_close(got_states.cpu(), ref_states, rtol=0, atol=0)
    assert torch.equal(got_states.cpu()[slots[4]], states[slots[4]])  # the empty sequence keeps its window
    assert torch.equal(got_states.cpu()[4], states[4]) and torch.equal(got_states.cpu()[6], states[6])


def test_split_sequences_continue_from_written_windows():
    """Two calls over consecutive pieces of each sequence equal one call over the whole sequences."""
    gen = torch.Generator().manual_seed(2)
    channels, kernel, lengths, split = 19, 4, [40, 2, 9], [37, 1, 0]
    weight = torch.randn(channels, kernel, generator=gen)
    xs = [torch.randn(n, channels, generator=gen) for n in lengths]
    states = torch.randn(3, channels, kernel - 1, generator=gen)
    slots = torch.tensor([2, 0, 1])

    whole_states = states.clone().to(DEVICE)
    whole = causal_conv1d_prefill(torch.cat(xs).to(DEVICE), weight.to(DEVICE), None, whole_states,
                                  slots.to(DEVICE), _offsets(lengths), config=SMALL_TILES).cpu()
    piece_states = states.clone().to(DEVICE)
    outs = []
    for part in (0, 1):
        pieces = [x[:s] if part == 0 else x[s:] for x, s in zip(xs, split)]
        cu = _offsets([p.shape[0] for p in pieces])
        y = causal_conv1d_prefill(torch.cat(pieces).to(DEVICE), weight.to(DEVICE), None, piece_states,
                                  slots.to(DEVICE), cu, cu_seqlens_cpu=cu, config=SMALL_TILES).cpu()
        outs.append([y[cu[b] : cu[b + 1]] for b in range(3)])
    whole_cu = _offsets(lengths)
    for b in range(3):
        torch.testing.assert_close(torch.cat([outs[0][b], outs[1][b]]), whole[whole_cu[b] : whole_cu[b + 1]])
    torch.testing.assert_close(piece_states.cpu(), whole_states.cpu())
