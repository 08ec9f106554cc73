"""The shared reference ops this plugin added to core/kernels, checked against transformers / direct math."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHRMSNormGated
from transformers.models.qwen3_next.modeling_qwen3_next import (
    Qwen3NextRMSNorm,
    Qwen3NextRMSNormGated,
    apply_rotary_pos_emb,
)

from armillary.kernels.activation import act_and_mul, get_activation, relu_squared
from armillary.kernels.conv1d import causal_conv1d_varlen
from armillary.kernels.moe import fused_moe, softmax_topk
from armillary.kernels.norm import gated_rms_norm, rms_norm
from armillary.kernels.rotary import apply_rotary, rotary_cos_sin, rotary_inv_freq


def test_zero_centered_rms_norm_matches_transformers():
    torch.manual_seed(0)
    ref = Qwen3NextRMSNorm(48, eps=1e-6)
    torch.nn.init.normal_(ref.weight, std=0.3)
    x = torch.randn(5, 3, 48)
    torch.testing.assert_close(rms_norm(x, ref.weight, 1e-6, zero_centered=True), ref(x))
    plain = rms_norm(x, ref.weight, 1e-6)
    torch.testing.assert_close(plain, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * ref.weight)


def test_gated_rms_norm_both_orders_match_transformers():
    torch.manual_seed(1)
    x, z = torch.randn(7, 64), torch.randn(7, 64)
    qwen = Qwen3NextRMSNormGated(64, eps=1e-6)
    torch.nn.init.normal_(qwen.weight, mean=1.0, std=0.3)
    torch.testing.assert_close(gated_rms_norm(x, z, qwen.weight, 1e-6), qwen(x, z))
    mamba = NemotronHRMSNormGated(64, group_size=16, eps=1e-5)
    torch.nn.init.normal_(mamba.weight, mean=1.0, std=0.3)
    got = gated_rms_norm(x, z, mamba.weight, 1e-5, group_size=16, norm_before_gate=False)
    torch.testing.assert_close(got, mamba(x, z))


@pytest.mark.parametrize("head_dim,rotary_dim", [(16, 4), (64, 64), (32, 16)])
def test_partial_rotary_matches_transformers(head_dim, rotary_dim):
    torch.manual_seed(2)
    positions = torch.tensor([0, 1, 2, 7, 100, 4095])
    inv_freq = rotary_inv_freq(rotary_dim, 1e6)
    cos, sin = rotary_cos_sin(positions, inv_freq)
    q, k = torch.randn(6, 4, head_dim), torch.randn(6, 2, head_dim)
    # transformers: [B, heads, T, D] with cos/sin duplicated over both halves
    full_cos, full_sin = torch.cat((cos, cos), -1)[None], torch.cat((sin, sin), -1)[None]
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], full_cos, full_sin)
    torch.testing.assert_close(apply_rotary(q, cos, sin), ref_q[0].transpose(0, 1))
    torch.testing.assert_close(apply_rotary(k, cos, sin), ref_k[0].transpose(0, 1))


def test_interleaved_rotary_is_complex_rotation_of_pairs():
    torch.manual_seed(3)
    positions = torch.arange(5)
    cos, sin = rotary_cos_sin(positions, rotary_inv_freq(8, 10000.0))
    x = torch.randn(5, 3, 12)
    got = apply_rotary(x, cos, sin, interleaved=True)
    pairs = torch.view_as_complex(x[..., :8].reshape(5, 3, 4, 2).contiguous())
    rotated = torch.view_as_real(pairs * torch.polar(torch.ones_like(cos), torch.atan2(sin, cos))[:, None]).flatten(-2)
    torch.testing.assert_close(got[..., :8], rotated)
    torch.testing.assert_close(got[..., 8:], x[..., 8:])


@pytest.mark.parametrize("with_bias", [False, True])
def test_causal_conv1d_varlen_continues_from_state(with_bias):
    torch.manual_seed(4)
    channels, kernel, lengths = 10, 4, [9, 1, 2, 30]
    xs = [torch.randn(n, channels) for n in lengths]
    weight = torch.randn(channels, kernel)
    bias = torch.randn(channels) if with_bias else None

    def reference(x):  # zero left padding over a whole sequence
        y = F.conv1d(x.T[None], weight[:, None], bias, padding=kernel - 1, groups=channels)[0, :, : x.shape[0]]
        return F.silu(y).T

    states = torch.zeros(6, channels, kernel - 1)
    slots = torch.tensor([5, 0, 3, 2])
    # each sequence in two steps (first part, then the rest) inside packed batches
    split = [4, 0, 1, 17]
    outs = [[], [], [], []]
    for part in (0, 1):
        pieces = [x[:s] if part == 0 else x[s:] for x, s in zip(xs, split)]
        cu = [0]
        for p in pieces:
            cu.append(cu[-1] + p.shape[0])
        y = causal_conv1d_varlen(torch.cat(pieces), weight, bias, states, slots, cu, activation="silu")
        for b in range(4):
            outs[b].append(y[cu[b] : cu[b + 1]])
    for b, x in enumerate(xs):
        torch.testing.assert_close(torch.cat(outs[b]), reference(x))
        torch.testing.assert_close(states[slots[b]], x[-(kernel - 1) :].T if x.shape[0] >= kernel - 1
                                   else torch.cat((torch.zeros(channels, kernel - 1 - x.shape[0]), x.T), 1))
    assert states[1].abs().sum() == 0  # untouched slot


def test_softmax_topk_renormalizes_only_when_asked():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 3.5, 0.0]])
    w, ids = softmax_topk(logits, 2, renormalize=False)
    probs = logits.softmax(-1)
    assert ids.tolist() == [[0, 1], [2, 1]]
    torch.testing.assert_close(w, probs.gather(1, ids))
    w_norm, _ = softmax_topk(logits, 2, renormalize=True)
    torch.testing.assert_close(w_norm, w / w.sum(-1, keepdim=True))


@pytest.mark.parametrize("activation", ["silu", "relu2"])
def test_fused_moe_matches_per_token_loop(activation):
    torch.manual_seed(5)
    tokens, hidden, inter, experts, top_k = 11, 16, 12, 5, 2
    gated = activation == "silu"
    w13 = torch.randn(experts, (2 if gated else 1) * inter, hidden) * 0.3
    w2 = torch.randn(experts, hidden, inter) * 0.3
    x = torch.randn(tokens, hidden)
    weights, ids = softmax_topk(torch.randn(tokens, experts), top_k, renormalize=True)
    act = get_activation(activation)
    expected = torch.zeros(tokens, hidden)
    for t in range(tokens):
        for j in range(top_k):
            e = ids[t, j]
            h = w13[e] @ x[t]
            h = act_and_mul(h, activation) if gated else act(h)
            expected[t] += weights[t, j] * (w2[e] @ h)
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids, activation), expected, rtol=1e-5, atol=1e-5)


def test_activation_names():
    x = torch.linspace(-3, 3, 13)
    torch.testing.assert_close(get_activation("relu2")(x), relu_squared(x))
    torch.testing.assert_close(relu_squared(x), F.relu(x) ** 2)
    torch.testing.assert_close(get_activation("gelu_pytorch_tanh")(x), F.gelu(x, approximate="tanh"))
    with pytest.raises(ValueError, match="unknown activation"):
        get_activation("swiglu_typo")
