"""The sigmoid + correction-bias router with group-limited top-k (core's reference and Triton kernel)
against transformers' ``NemotronHTopkRouter``, and the one-group call unchanged."""
from __future__ import annotations

import pytest
import torch

from armillary.kernels import moe as moe_ref
from armillary.kernels import reference
from armillary.kernels.triton import moe_routing


def hf_router(logits, bias, top_k, n_group, topk_group, renormalize, scaling):
    """transformers' NemotronHTopkRouter.forward from the logits on (same config fields)."""
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHTopkRouter

    experts = logits.shape[1]
    cfg = NemotronHConfig(n_routed_experts=experts, num_experts_per_tok=top_k, n_group=n_group,
                          topk_group=topk_group, norm_topk_prob=renormalize, routed_scaling_factor=scaling,
                          hidden_size=experts)
    router = NemotronHTopkRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.eye(experts))  # logits pass through unchanged
        router.e_score_correction_bias.copy_(bias)
    _, weights, ids = router(logits)
    return weights, ids


def canonical(weights, ids):
    """Slots sorted by expert id (the order of the top-k is free)."""
    order = ids.long().argsort(dim=-1)
    return weights.gather(1, order), ids.long().gather(1, order)


@pytest.mark.parametrize("experts,top_k,n_group,topk_group", [(16, 4, 4, 2), (24, 6, 8, 3), (12, 2, 1, 1),
                                                               (40, 5, 5, 1)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_group_limited_router_matches_transformers(experts, top_k, n_group, topk_group, renormalize):
    gen = torch.Generator().manual_seed(experts + top_k)
    logits = torch.randn(9, experts, generator=gen) * 2
    bias = torch.randn(experts, generator=gen) * 0.3
    ref_w, ref_ids = canonical(*hf_router(logits, bias, top_k, n_group, topk_group, renormalize, 2.5))
    w, ids = canonical(*moe_ref.sigmoid_topk(logits, bias, top_k, renormalize, 2.5, n_group, topk_group))
    assert torch.equal(ids, ref_ids) and torch.allclose(w, ref_w, rtol=1e-6, atol=1e-7)
    tw, tids = canonical(*moe_routing.topk_sigmoid_bias(logits, bias, top_k, renormalize, 2.5,
                                                        n_group=n_group, topk_group=topk_group))
    assert torch.equal(tids, ref_ids) and torch.allclose(tw, ref_w, rtol=1e-6, atol=1e-7)


def test_group_limited_router_with_shared_columns():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 16, generator=gen)
    bias = torch.randn(16, generator=gen) * 0.1
    w, ids = reference.sigmoid_topk(logits, bias, 3, True, 1.5, 2, n_group=4, topk_group=2)
    tw, tids = moe_routing.topk_sigmoid_bias(logits, bias, 3, True, 1.5, 2, n_group=4, topk_group=2)
    assert ids[:, 3:].tolist() == [[16, 17]] * 3 and tids[:, 3:].tolist() == [[16, 17]] * 3
    assert torch.equal(w[:, 3:], torch.ones(3, 2)) and torch.equal(tw[:, 3:], torch.ones(3, 2))
    assert torch.equal(canonical(w[:, :3], ids[:, :3])[1], canonical(tw[:, :3], tids[:, :3])[1])


def test_one_group_signature_unchanged():
    """The positional one-group call (what other plugins make) gives what it gave before: plain top-k."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 10, generator=gen)
    bias = torch.randn(10, generator=gen) * 0.2
    w, ids = reference.sigmoid_topk(logits, bias, 3, True, 1.0, 0)
    scores = logits.sigmoid()
    expect = torch.topk(scores + bias, 3).indices
    assert torch.equal(ids, expect)
    tw, tids = moe_routing.topk_sigmoid_bias(logits, bias, 3, True)
    assert torch.equal(tids.long(), expect) and torch.allclose(tw, w)
