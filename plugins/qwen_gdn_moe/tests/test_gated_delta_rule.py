"""The chunked (WY) gated delta rule against the recurrent one and against transformers' torch fallbacks."""
from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_next.modeling_qwen3_next import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from armillary_qwen_gdn_moe.ops.gated_delta_rule import chunk_gated_delta_rule_ref, recurrent_gated_delta_rule_ref


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


def make_inputs(lengths, num_k_heads, num_v_heads, head_k, head_v, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(total, num_k_heads, head_k, generator=gen).to(dtype)
    k = torch.randn(total, num_k_heads, head_k, generator=gen).to(dtype)
    v = torch.randn(total, num_v_heads, head_v, generator=gen).to(dtype)
    # realistic decays: g = -A · softplus(a + dt_bias), mostly small, a few strong
    g = -torch.rand(total, num_v_heads, generator=gen).pow(3) * 2.0
    beta = torch.rand(total, num_v_heads, generator=gen).to(dtype)
    state = torch.randn(len(lengths), num_v_heads, head_k, head_v, generator=gen) * 0.5
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return q, k, v, g, beta, cu, state


SHAPES = [
    # lengths, H, HV, K, V, chunk
    ([63], 2, 4, 60, 36, 64),
    ([63, 1, 130, 64], 2, 4, 60, 36, 64),
    ([5, 65, 17], 3, 3, 32, 48, 64),
    ([40, 7, 33], 1, 3, 24, 16, 16),
]


@pytest.mark.parametrize("lengths,H,HV,K,V,chunk", SHAPES)
def test_chunked_matches_recurrent_from_initial_states(lengths, H, HV, K, V, chunk):
    q, k, v, g, beta, cu, state = make_inputs(lengths, H, HV, K, V)
    o_rec, s_rec = recurrent_gated_delta_rule_ref(q, k, v, g, beta, cu, initial_state=state)
    o_chk, s_chk = chunk_gated_delta_rule_ref(q, k, v, g, beta, cu, initial_state=state, chunk_size=chunk)
    assert o_chk.shape == (sum(lengths), HV, V) and s_chk.shape == (len(lengths), HV, K, V)
    assert s_chk.dtype == torch.float32
    assert rel_err(o_chk, o_rec) < 1e-5
    assert rel_err(s_chk, s_rec) < 1e-5
    # the initial state matters: starting from zeros gives a different answer
    o_zero, _ = chunk_gated_delta_rule_ref(q, k, v, g, beta, cu, initial_state=None, chunk_size=chunk)
    assert rel_err(o_zero, o_chk) > 1e-2


def test_split_sequence_continues_from_final_state():
    """Running a sequence in two calls, passing the state on, equals one call (chunked prefill)."""
    q, k, v, g, beta, _, state = make_inputs([100], 2, 4, 60, 36, seed=3)
    whole, s_whole = chunk_gated_delta_rule_ref(q, k, v, g, beta, [0, 100], initial_state=state[:1])
    first, s_mid = chunk_gated_delta_rule_ref(q[:37], k[:37], v[:37], g[:37], beta[:37], [0, 37], initial_state=state[:1])
    second, s_end = chunk_gated_delta_rule_ref(q[37:], k[37:], v[37:], g[37:], beta[37:], [0, 63], initial_state=s_mid)
    assert rel_err(torch.cat([first, second]), whole) < 1e-5
    assert rel_err(s_end, s_whole) < 1e-5


def test_low_precision_inputs_keep_float32_state():
    q, k, v, g, beta, cu, state = make_inputs([70, 3], 2, 4, 32, 32, seed=5, dtype=torch.bfloat16)
    o, s = chunk_gated_delta_rule_ref(q, k, v, g, beta, cu, initial_state=state)
    o32, s32 = chunk_gated_delta_rule_ref(q.float(), k.float(), v.float(), g, beta.float(), cu, initial_state=state)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert rel_err(o, o32) < 1e-2 and rel_err(s, s32) < 1e-5


@pytest.mark.parametrize("lengths,H,HV,K,V,chunk", SHAPES[1:3])
def test_matches_transformers_torch_fallbacks(lengths, H, HV, K, V, chunk):
    q, k, v, g, beta, cu, state = make_inputs(lengths, H, HV, K, V, seed=11)
    o_chk, s_chk = chunk_gated_delta_rule_ref(q, k, v, g, beta, cu, initial_state=state)
    o_rec, s_rec = recurrent_gated_delta_rule_ref(q, k, v, g, beta, cu, initial_state=state)
    for b in range(len(lengths)):
        s, e = cu[b], cu[b + 1]
        args = (q[None, s:e], k[None, s:e], v[None, s:e])
        kw = dict(g=g[None, s:e], beta=beta[None, s:e], initial_state=state[b : b + 1].clone(),
                  output_final_state=True, use_qk_l2norm_in_kernel=True)
        ref_o, ref_s = torch_chunk_gated_delta_rule(*args, **kw)
        assert rel_err(o_chk[s:e], ref_o[0]) < 1e-5
        assert rel_err(s_chk[b], ref_s[0]) < 1e-5
        kw["initial_state"] = state[b : b + 1].clone()
        ref_o, ref_s = torch_recurrent_gated_delta_rule(*args, **kw)
        assert rel_err(o_rec[s:e], ref_o[0]) < 1e-5
        assert rel_err(s_rec[b], ref_s[0]) < 1e-5
