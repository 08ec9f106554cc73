"""A speculative verify step through the Mamba-2 mixer at odd sizes under the CPU interpreter.

``mamba_verify`` (3 groups of 2 heads, head dim 12, state 10) on both paths, the fused Triton verify
kernel and the fp32 reference, against position-by-position naive steps: row i of
``spec_state_rows`` must hold the conv window and SSM state after position i, the slot the state
after the last one, and no other row may change. Then the kernel itself (``mamba_verify_step``, heads
3, head dim 12, state 20, groups 1 and 3, conv 4, K = 1..3, B = 1 and 5, fp32 and bf16, whole-head and
row-split launches) against K + 1 chained ``mamba_decode_step`` launches and the naive chain, and a
verify-graph batch whose padding rows share a scratch slot."""
from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from armillary.hf_config import HFConfig
from armillary_nemotron.config import NemotronHArgs
from armillary_nemotron.mamba_mixer import Mamba2Mixer
from armillary_nemotron.mamba_verify import mamba_verify
from armillary_nemotron.ops.mamba.naive import causal_conv1d_update_ref, selective_state_update_ref, verify_steps_ref
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


# ---- the fused kernel (ops/mamba/verify.py) against K + 1 chained decode launches and the naive chain ----

def _verify_args(batch: int, k: int, heads: int, p: int, g: int, n: int, kw: int, dtype: torch.dtype, seed: int):
    """Kernel arguments of one verify step (sequence-major rows, column views of one in_proj output) and
    pools of 2·B + B·K + 3 rows: slots, spec rows and three rows no one names, in a shuffled order."""
    gen = torch.Generator().manual_seed(seed)
    d_inner, conv_dim = heads * p, heads * p + 2 * g * n
    projected = torch.randn(batch * (k + 1), d_inner + conv_dim + heads, generator=gen).to(dtype)
    z, xbc, dt = projected.split([d_inner, conv_dim, heads], dim=-1)
    total = batch * (k + 1) + 3
    perm = torch.randperm(total, generator=gen)
    args = dict(xbc=xbc, z=z, dt=dt, conv_weight=(torch.randn(conv_dim, kw, generator=gen) * 0.5).to(dtype),
                conv_bias=torch.randn(conv_dim, generator=gen).to(dtype), A_log=torch.randn(heads, generator=gen) * 0.5,
                D=torch.randn(heads, generator=gen), dt_bias=torch.randn(heads, generator=gen) * 0.5 - 0.5,
                dt_min=1e-3, norm_weight=(1 + 0.3 * torch.randn(d_inner, generator=gen)).to(dtype), eps=1e-5,
                state_slots=perm[:batch].clone(), spec_rows=perm[batch:batch * (k + 1)].view(batch, k).clone(),
                heads=heads, head_dim=p)
    conv = torch.randn(total, conv_dim, kw - 1, generator=gen).to(dtype)
    ssm = torch.randn(total, heads, p, n, generator=gen) * 0.5  # fp32 states, as the mixer keeps them
    return args, conv, ssm, perm[batch * (k + 1):]


def _run(fn, args: dict, conv: torch.Tensor, ssm: torch.Tensor, **over):
    conv, ssm = conv.clone(), ssm.clone()
    out = fn(conv_states=conv, ssm_states=ssm, **{**args, **over})
    return out, conv, ssm


def _naive_chain(args: dict, conv: torch.Tensor, ssm: torch.Tensor):
    from armillary.kernels.norm import gated_rms_norm

    conv, ssm = conv.clone(), ssm.clone()
    a = args
    y = verify_steps_ref(a["xbc"], a["dt"], a["conv_weight"], a["conv_bias"], -torch.exp(a["A_log"]), a["D"],
                         a["dt_bias"], a["dt_min"], conv, ssm, a["state_slots"], a["spec_rows"], a["heads"],
                         a["head_dim"])
    d_inner = a["heads"] * a["head_dim"]
    groups = (a["xbc"].shape[1] - d_inner) // (2 * ssm.shape[-1])
    out = gated_rms_norm(y.reshape(-1, d_inner), a["z"].float(), a["norm_weight"].float(), a["eps"],
                         group_size=d_inner // groups, norm_before_gate=False)
    return out, conv, ssm


def _max_rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()


# (groups, split_p, K, B): split 0 takes whole heads (3 groups of 1 head: one program per group, no ticket),
# 4 three blocks per head (tickets always); every K at B = 1, B = 5 at K = 2 (the interpreter's cost grows with B)
VERIFY_CASES = [(g, 0, k, 1) for g in (1, 3) for k in (1, 2, 3)] + [(g, 0, 2, 5) for g in (1, 3)] + \
    [(g, 4, k, 1) for g in (1, 3) for k in (1, 3)]  # split 4 at B = 5: the padding test below


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("groups,split,k,batch", VERIFY_CASES)
@torch.no_grad()
def test_fused_verify_equals_chained_decode_steps(groups, split, k, batch, dtype):
    """Heads 3, head dim 12, state 20, conv 4: outputs, every spec row and slot (state and window) as K + 1
    chained ``mamba_decode_step`` launches and as the naive chain; the rows no one names untouched, the
    tickets back at zero, a repeat bit-identical (B = 1)."""
    from armillary.kernels.triton.device_buffers import ticket_buffer
    from armillary_nemotron.ops.mamba.verify import chained_decode_verify, mamba_verify_step

    args, conv, ssm, untouched = _verify_args(batch, k, 3, 12, groups, 20, 4, dtype, seed=100 * k + 10 * batch + groups)
    cfg = {"split_p": split, "num_warps": 1}
    got, got_conv, got_ssm = _run(mamba_verify_step, args, conv, ssm, config=cfg)
    want, want_conv, want_ssm = _run(chained_decode_verify, args, conv, ssm, config=cfg)
    ref, ref_conv, ref_ssm = _naive_chain(args, conv, ssm)
    written = torch.cat([args["spec_rows"].flatten(), args["state_slots"]])
    out_tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: one rounding of the output apart at most
    assert got.dtype == dtype and _max_rel(got, want) < out_tol
    assert _max_rel(got_ssm[written], want_ssm[written]) < 1e-6
    assert torch.equal(got_conv, want_conv)  # every window, written or not, bit for bit
    assert _max_rel(got, ref) < (1e-5 if dtype == torch.float32 else 3e-2)
    assert _max_rel(got_ssm[written], ref_ssm[written]) < (1e-5 if dtype == torch.float32 else 2e-2)
    assert torch.equal(got_conv[written], ref_conv[written])
    assert torch.equal(got_ssm[untouched], ssm[untouched]) and torch.equal(got_conv[untouched], conv[untouched])
    assert not ticket_buffer(torch.device("cpu"), 0).any()
    if batch == 1:  # determinism (the norm's partials summed in a fixed order)
        again, again_conv, again_ssm = _run(mamba_verify_step, args, conv, ssm, config=cfg)
        assert torch.equal(again, got) and torch.equal(again_ssm, got_ssm) and torch.equal(again_conv, got_conv)


@pytest.mark.parametrize("split", [0, 4])
@torch.no_grad()
def test_fused_verify_padding_rows_and_transposed_spec_rows(split):
    """A verify-graph batch: 2 live sequences, 3 padding rows all on one scratch slot and its scratch spec
    rows, spec rows as the graphs pass them (a transposed view): the live rows' outputs and state rows
    as those of the live sequences alone; no row outside live, scratch and spec rows changes."""
    from armillary_nemotron.ops.mamba.verify import mamba_verify_step

    k, heads, p, g, n = 2, 3, 12, 1, 20
    args, conv, ssm, untouched = _verify_args(5, k, heads, p, g, n, 4, torch.float32, seed=7)
    scratch_slot, scratch_rows = args["state_slots"][4], args["spec_rows"][4]
    seq = torch.empty(1 + k, 5, dtype=torch.long)  # the graphs' layout: slot row, then one row per draft position
    seq[0] = torch.cat([args["state_slots"][:2], scratch_slot.repeat(3)])
    seq[1:] = torch.cat([args["spec_rows"][:2], scratch_rows.repeat(3, 1)]).t()
    cfg = {"split_p": split, "num_warps": 1}
    padded = {**args, "state_slots": seq[0], "spec_rows": seq[1:].t()}
    got, got_conv, got_ssm = _run(mamba_verify_step, padded, conv, ssm, config=cfg)
    live_rows = 2 * (k + 1)
    live = {**args, **{name: args[name][:live_rows] for name in ("xbc", "z", "dt")},
            "state_slots": args["state_slots"][:2], "spec_rows": args["spec_rows"][:2]}
    want, want_conv, want_ssm = _run(mamba_verify_step, live, conv, ssm, config=cfg)
    written = torch.cat([args["spec_rows"][:2].flatten(), args["state_slots"][:2]])
    assert torch.equal(got[:live_rows], want)
    assert torch.equal(got_ssm[written], want_ssm[written]) and torch.equal(got_conv[written], want_conv[written])
    kept = torch.cat([untouched, args["state_slots"][2:4], args["spec_rows"][2:4].flatten()])
    assert torch.equal(got_ssm[kept], ssm[kept]) and torch.equal(got_conv[kept], conv[kept])


@torch.no_grad()
def test_fast_path_is_one_fused_launch(monkeypatch):
    """The mixer's fast verify path is one ``mamba_verify_step`` call: no decode step, no row copy."""
    from armillary_nemotron.ops.mamba import decode as tri_decode
    from armillary_nemotron.ops.mamba import verify as tri_verify

    calls = {"verify": 0, "decode": 0, "copies": 0}
    fused, decode, index_copy = tri_verify.mamba_verify_step, tri_decode.mamba_decode_step, torch.Tensor.index_copy_

    def count(name, fn):
        def spy(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)
        return spy

    monkeypatch.setattr(tri_verify, "mamba_verify_step", count("verify", fused))
    monkeypatch.setattr(tri_decode, "mamba_decode_step", count("decode", decode))
    monkeypatch.setattr(torch.Tensor, "index_copy_", count("copies", index_copy))
    mixer, k = _mixer(seed=5), 2
    gen = torch.Generator().manual_seed(5)
    conv = torch.randn(9, mixer.conv_dim, KW - 1, generator=gen)
    ssm = torch.randn(9, HEADS, P, N, generator=gen)
    mixed = torch.randn(2 * (k + 1), HEADS * P + mixer.conv_dim + HEADS, generator=gen)
    batch = types.SimpleNamespace(spec_state_rows=torch.tensor([[2, 3], [4, 5]]), state_slots=torch.tensor([1, 0]))
    out = mamba_verify(mixer, mixed, batch, conv, ssm, fast=True)
    assert out.shape == (2 * (k + 1), HEADS * P) and calls == {"verify": 1, "decode": 0, "copies": 0}
