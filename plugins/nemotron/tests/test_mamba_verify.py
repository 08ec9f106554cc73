"""A speculative verify step through the Mamba-2 mixer (``mamba_verify``), at odd sizes (3 groups of 2
heads, head dim 12, state 10), on both paths: the fused Triton decode kernel chained over state rows
(under the CPU interpreter) and the fp32 reference, against position-by-position naive steps. Row i of
``spec_state_rows`` must hold the conv window and SSM state after position i, the slot the state after
the last one, and no other row may change."""
from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from armillary.hf_config import HFConfig
from armillary_nemotron.config import NemotronHArgs
from armillary_nemotron.mamba_mixer import Mamba2Mixer
from armillary_nemotron.mamba_verify import mamba_verify
from armillary_nemotron.ops.mamba.naive import causal_conv1d_update_ref, selective_state_update_ref
from plugins.nemotron.tests.hf_models import CASES_BY_NAME

HEADS, P, G, N, KW = 6, 12, 3, 10, 4


def _mixer(seed: int) -> Mamba2Mixer:
    hf = HFConfig(dict(CASES_BY_NAME["ME*ME_groups2_chunk8"].config, hybrid_override_pattern="M", hidden_size=40,
                       mamba_num_heads=HEADS, mamba_head_dim=P, n_groups=G, ssm_state_size=N, conv_kernel=KW))
    mixer = Mamba2Mixer(NemotronHArgs.parse(hf))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in mixer.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if name != "A_log" else 0.3))
    return mixer


def _naive(mixer: Mamba2Mixer, mixed: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor,
           slots: torch.Tensor) -> torch.Tensor:
    """One token per sequence from the naive references and a hand-written grouped gated norm: [B, d_inner]."""
    num, d_inner, gn = mixed.shape[0], HEADS * P, G * N
    z, xbc, dt = mixed.split([d_inner, mixer.conv_dim, HEADS], dim=-1)
    xbc = causal_conv1d_update_ref(xbc, mixer.conv1d.weight[:, 0], mixer.conv1d.bias, conv, slots)
    x, B, C = xbc.split([d_inner, gn, gn], dim=-1)
    y = selective_state_update_ref(x.reshape(num, HEADS, P), dt, -torch.exp(mixer.A_log), B.reshape(num, G, N),
                                   C.reshape(num, G, N), mixer.D, mixer.dt_bias, mixer.dt_min, ssm, slots)
    gated = (y.reshape(num, d_inner) * F.silu(z.float())).view(num, G, -1)
    normed = gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + mixer.norm.eps)
    return normed.view(num, d_inner) * mixer.norm.weight.float()


@pytest.mark.parametrize("fast", [False, True], ids=["reference", "triton"])
@pytest.mark.parametrize("k", [1, 3])
@torch.no_grad()
def test_verify_keeps_the_state_after_every_position(fast, k):
    mixer = _mixer(seed=k)
    gen = torch.Generator().manual_seed(10 + k)
    slots = torch.tensor([4, 0, 2])
    rows = torch.tensor([[6 + k * b + i for i in range(k)] for b in range(3)])  # [B, K] distinct state rows
    total = 6 + 3 * k + 2  # two rows no one names
    conv = torch.randn(total, mixer.conv_dim, KW - 1, generator=gen)
    ssm = torch.randn(total, HEADS, P, N, generator=gen)
    mixed = torch.randn(3 * (k + 1), HEADS * P + mixer.conv_dim + HEADS, generator=gen)  # [B (K+1), in_proj out]
    batch = types.SimpleNamespace(spec_state_rows=rows, state_slots=slots)  # all the verify path reads
    got_conv, got_ssm = conv.clone(), ssm.clone()
    got = mamba_verify(mixer, mixed, batch, got_conv, got_ssm, fast)  # [B (K+1), d_inner]

    want_conv, want_ssm = conv.clone(), ssm.clone()
    steps = mixed.view(3, k + 1, -1)
    for i in range(k + 1):  # naive steps on the slots, the state after position i < K copied to its row
        out = _naive(mixer, steps[:, i], want_conv, want_ssm, slots)
        err = ((got.view(3, k + 1, -1)[:, i] - out).abs().max() / out.abs().max()).item()
        assert err < 1e-5, f"position {i}: relative error {err:.2e}"
        if i < k:
            assert torch.allclose(got_conv[rows[:, i]], want_conv[slots], rtol=1e-6, atol=1e-6), f"conv row {i}"
            assert torch.allclose(got_ssm[rows[:, i]], want_ssm[slots], rtol=1e-5, atol=1e-5), f"state row {i}"
    assert torch.allclose(got_conv[slots], want_conv[slots], rtol=1e-6, atol=1e-6)
    assert torch.allclose(got_ssm[slots], want_ssm[slots], rtol=1e-5, atol=1e-5)
    untouched = [1, 3, 5, total - 2, total - 1]
    assert torch.equal(got_conv[untouched], conv[untouched]) and torch.equal(got_ssm[untouched], ssm[untouched])
