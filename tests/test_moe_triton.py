"""Triton MoE (routing, align, grouped and decode expert GEMMs) against the torch references.

Runs under TRITON_INTERPRET=1 on CPU at tiny odd sizes; on a CUDA machine the same tests run compiled.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from armillary.kernels.moe import fused_moe as reference_moe  # noqa: E402
from armillary.kernels.moe import softmax_topk  # noqa: E402
from armillary.kernels.triton.moe import fused_moe, grouped_config_key  # noqa: E402
from armillary.kernels.triton.moe_align import max_aligned_blocks, moe_align  # noqa: E402
from armillary.kernels.triton.moe_routing import topk_sigmoid_bias, topk_softmax  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E, K, H, I = 5, 2, 40, 24
# small tiles so tiny shapes still span several blocks, uneven K (40 % 32, 24 % 16) and clamped N
GROUPED_TINY = {
    "BLOCK_M": 16, "GROUP_M": 2,
    "BLOCK_N1": 16, "BLOCK_K1": 32, "num_warps1": 2, "num_stages1": 1,
    "BLOCK_N2": 16, "BLOCK_K2": 16, "num_warps2": 2, "num_stages2": 1,
}  # fmt: skip
DECODE_TINY = {
    "BLOCK_N1": 16, "BLOCK_K1": 32, "num_warps1": 2, "num_stages1": 1,
    "BLOCK_N2": 16, "BLOCK_K2": 16, "num_warps2": 2, "num_stages2": 1,
}  # fmt: skip


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def sigmoid_router_reference(logits, bias, top_k, renormalize, scaling):
    """Nemotron-H / GLM router, n_group 1: choose on sigmoid + bias, weigh by the plain sigmoid."""
    scores = logits.float().sigmoid()
    ids = torch.topk(scores + bias, top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def make_moe(num_tokens, dtype, gated, seed=0, hidden=H, inter=I, experts=E):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g).to(DEVICE, dtype)
    rows = 2 * inter if gated else inter
    w13 = (torch.randn(experts, rows, hidden, generator=g) / hidden**0.5).to(DEVICE, dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).to(DEVICE, dtype)
    logits = torch.randn(num_tokens, experts, generator=g).to(DEVICE)
    weights, ids = softmax_topk(logits, K, True)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("num_tokens", [1, 3, 17])
@pytest.mark.parametrize("renormalize", [True, False])
def test_topk_softmax_matches_reference(num_tokens, renormalize):
    logits = torch.randn(num_tokens, E, generator=torch.Generator().manual_seed(num_tokens)).to(DEVICE)
    weights, ids = topk_softmax(logits.half(), K, renormalize)
    ref_w, ref_ids = softmax_topk(logits.half(), K, renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(weights, ref_w, rtol=1e-5, atol=1e-6)


def test_topk_softmax_appends_gated_shared_expert():
    logits = torch.randn(7, E + 1, generator=torch.Generator().manual_seed(3)).to(DEVICE)  # router ‖ shared gate
    weights, ids = topk_softmax(logits[:, :E], K, True, num_shared=1, shared_gate_logits=logits[:, E])
    ref_w, ref_ids = softmax_topk(logits[:, :E], K, True)
    assert torch.equal(ids[:, :K].long(), ref_ids)
    assert torch.equal(ids[:, K], torch.full((7,), E, dtype=torch.int32, device=DEVICE))
    torch.testing.assert_close(weights[:, :K], ref_w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weights[:, K], logits[:, E].sigmoid(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("num_tokens", [1, 17])
@pytest.mark.parametrize("renormalize", [True, False])
def test_topk_sigmoid_bias_matches_reference(num_tokens, renormalize):
    g = torch.Generator().manual_seed(num_tokens + 10)
    experts, top_k = 13, 3
    logits = torch.randn(num_tokens, experts, generator=g).to(DEVICE)
    bias = (torch.randn(experts, generator=g) * 0.5).to(DEVICE)  # large enough to change the choice
    weights, ids = topk_sigmoid_bias(logits, bias, top_k, renormalize, scaling=2.5, num_shared=2)
    ref_w, ref_ids = sigmoid_router_reference(logits, bias, top_k, renormalize, 2.5)
    assert torch.equal(ids[:, :top_k].long(), ref_ids)
    torch.testing.assert_close(weights[:, :top_k], ref_w, rtol=1e-5, atol=1e-6)
    assert torch.equal(ids[:, top_k:].cpu(), torch.tensor([[experts, experts + 1]] * num_tokens, dtype=torch.int32))
    assert torch.equal(weights[:, top_k:].cpu(), torch.ones(num_tokens, 2))


@pytest.mark.parametrize("one_program", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 3, 17])
def test_moe_align_groups_every_pair_once(num_tokens, one_program):
    _, _, _, _, ids = make_moe(num_tokens, torch.float32, True, seed=num_tokens)
    block_m = 4
    align = moe_align(ids, E, block_m, one_program=one_program)
    flat = ids.reshape(-1).cpu()
    counts = torch.bincount(flat, minlength=E)
    offsets, sorted_ids = align.expert_offsets.cpu(), align.sorted_pair_ids.cpu()
    blocks = align.block_expert.cpu()
    assert torch.equal(align.expert_counts.cpu(), counts.int())
    assert align.max_blocks == max_aligned_blocks(flat.numel(), E, block_m)
    seen = []
    for e in range(E):
        start = offsets[e].item()
        assert start % block_m == 0
        rows = sorted_ids[start : start + counts[e]]
        assert bool((flat[rows.long()] == e).all())
        seen += rows.tolist()
        used_blocks = -(-counts[e].item() // block_m)
        assert bool((blocks[start // block_m : start // block_m + used_blocks] == e).all())
    assert sorted(seen) == list(range(flat.numel()))
    used = offsets[E].item() // block_m
    assert bool((blocks[used:] == -1).all()) and used <= align.max_blocks


@pytest.mark.parametrize("num_tokens, experts, block_m", [(64, 257, 16), (5, 129, 64), (1, 3, 16)])
def test_one_program_alignment_equals_the_two_launch_one(num_tokens, experts, block_m):
    """A decode batch's shape (64 tokens x 8 routed + 1 shared of 257 experts): the one-launch path's counts,
    offsets and block map equal the two-launch path's, and each expert's rows hold the same pairs."""
    g = torch.Generator().manual_seed(num_tokens)
    ids = torch.cat([torch.randint(0, experts - 1, (num_tokens, 8), generator=g),
                     torch.full((num_tokens, 1), experts - 1)], dim=1).to(torch.int32).to(DEVICE)
    one, two = (moe_align(ids, experts, block_m, one_program=flag) for flag in (True, False))
    for name in ("expert_counts", "expert_offsets", "block_expert"):
        assert torch.equal(getattr(one, name), getattr(two, name)), name
    offsets, counts = two.expert_offsets.cpu(), two.expert_counts.cpu()
    for e in range(experts):
        rows = slice(offsets[e].item(), offsets[e].item() + counts[e].item())
        assert sorted(one.sorted_pair_ids.cpu()[rows].tolist()) == sorted(two.sorted_pair_ids.cpu()[rows].tolist())


def test_the_table_picks_the_one_program_path_by_pair_count(monkeypatch):
    from armillary.kernels.triton import moe_align as align_mod

    launched = []
    real = align_mod._align_one_program_kernel
    monkeypatch.setattr(align_mod, "_align_one_program_kernel", type("Spy", (), {
        "__getitem__": lambda self, grid: (launched.append(grid), real[grid])[1]})())
    monkeypatch.setattr(align_mod, "one_program_config", lambda device: {"one_program_max_pairs": 24, "num_warps": 4})
    ids = torch.randint(0, 7, (3, 8), dtype=torch.int32).to(DEVICE)
    moe_align(ids, 7, 4)  # 24 pairs: one program
    moe_align(torch.cat([ids, ids[:1]]), 7, 4)  # 32: two launches
    assert launched == [(1,)]
    with pytest.raises(ValueError, match="one program"):
        moe_align(torch.zeros(0, 8, dtype=torch.int32, device=DEVICE), 7, 4, one_program=True)


@pytest.mark.parametrize("num_tokens", [1, 3, 17])
@pytest.mark.parametrize("activation", ["silu", "relu2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("path", ["grouped", "decode"])
def test_fused_moe_matches_reference(num_tokens, activation, dtype, path):
    gated = activation == "silu"
    x, w13, w2, weights, ids = make_moe(num_tokens, dtype, gated, seed=num_tokens)
    cfg = GROUPED_TINY if path == "grouped" else DECODE_TINY
    out = fused_moe(x, w13, w2, weights, ids.int(), activation, path=path, config=cfg)
    ref = reference_moe(x.float(), w13.float(), w2.float(), weights, ids, activation)
    assert out.dtype == dtype and out.shape == x.shape
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 5e-3)


@pytest.mark.parametrize("path", ["grouped", "decode"])
def test_fused_moe_expert_chosen_by_every_token(path):
    """One expert serves 19 pairs: several BLOCK_M blocks (grouped), more than 16 MMA rows (decode)."""
    x, w13, w2, weights, ids = make_moe(19, torch.float16, True, seed=5)
    ids = torch.stack((torch.full_like(ids[:, 0], 3), torch.arange(19, device=DEVICE) % 3), dim=1)
    cfg = GROUPED_TINY if path == "grouped" else DECODE_TINY
    out = fused_moe(x, w13, w2, weights, ids, "silu", path=path, config=cfg)
    ref = reference_moe(x.float(), w13.float(), w2.float(), weights, ids, "silu")
    assert rel_err(out, ref) < 5e-3


@pytest.mark.parametrize("path", ["grouped", "decode"])
def test_fused_moe_even_k_and_default_config(path):
    """Dims that divide the K tiles take the unmasked loads; no config override uses the defaults."""
    x, w13, w2, weights, ids = make_moe(5, torch.float16, True, seed=7, hidden=64, inter=32)
    out = fused_moe(x, w13, w2, weights, ids, "silu", path=path)
    ref = reference_moe(x.float(), w13.float(), w2.float(), weights, ids, "silu")
    assert rel_err(out, ref) < 5e-3


def test_shared_expert_stacked_behind_routed_ones():
    """Routed experts + sigmoid-gated shared expert in one call equals the two computed apart."""
    x, w13, w2, _, _ = make_moe(6, torch.float32, True, seed=11)
    g = torch.Generator().manual_seed(12)
    shared13 = (torch.randn(1, 2 * I, H, generator=g) / H**0.5).to(DEVICE)
    shared2 = (torch.randn(1, H, I, generator=g) / I**0.5).to(DEVICE)
    logits = torch.randn(6, E + 1, generator=g).to(DEVICE)
    weights, ids = topk_softmax(logits[:, :E], K, True, num_shared=1, shared_gate_logits=logits[:, E])
    out = fused_moe(x, torch.cat((w13, shared13)), torch.cat((w2, shared2)), weights, ids, path="grouped", config=GROUPED_TINY)
    ref_w, ref_ids = softmax_topk(logits[:, :E], K, True)
    routed = reference_moe(x, w13, w2, ref_w, ref_ids)
    shared = reference_moe(x, shared13, shared2, logits[:, E:].sigmoid(), torch.zeros(6, 1, dtype=torch.long, device=DEVICE))
    assert rel_err(out, routed + shared) < 1e-5


def test_grouped_config_key_buckets():
    assert grouped_config_key(1 * 8, 256) == "r8"
    assert grouped_config_key(512 * 8, 256) == "r32"
    assert grouped_config_key(2048 * 8, 256) == "r128"
    assert grouped_config_key(16384 * 8, 256) == "r512"
    assert grouped_config_key(65536 * 8, 256) == "r512"


def test_fused_moe_rejects_mismatched_weights():
    x, w13, w2, weights, ids = make_moe(2, torch.float32, True)
    with pytest.raises(ValueError, match="fits neither"):
        fused_moe(x, w13[:, :-1], w2, weights, ids)
    with pytest.raises(ValueError, match="activation"):
        fused_moe(x, w13, w2, weights, ids, "gelu")


@pytest.mark.parametrize("weighted", [False, True])
def test_sum_topk_weights_each_pair_row(weighted):
    """The one-pass combine the quantized MoEs share: Σ_j (w_j ·) row_j in fp32 into out's dtype; N past a tile."""
    from armillary.kernels.triton.moe import sum_topk

    g = torch.Generator().manual_seed(3)
    t, k, n = 5, 3, 1500
    pairs = torch.randn(t * k, n, generator=g).to(torch.bfloat16).to(DEVICE)
    weights = torch.rand(t, k, generator=g).to(DEVICE)
    out = sum_topk(pairs, k, torch.empty(t, n, dtype=torch.float32, device=DEVICE), weights if weighted else None)
    rows = pairs.view(t, k, n).float()
    want = (rows * weights.unsqueeze(-1)).sum(1) if weighted else rows.sum(1)
    assert torch.allclose(out, want, rtol=1e-6, atol=1e-6)
    empty = torch.empty(0, n, dtype=torch.bfloat16, device=DEVICE)
    assert sum_topk(pairs[:0], k, empty, weights[:0]) is empty
