"""FP8 KV cache: the layout rewrite (high-precision layers stay in the model dtype) and the reference attention over fp8 pages vs bf16 pages."""
from __future__ import annotations

import pytest
import torch

from armillary.cache_spec import FullAttention, Recurrent
from armillary.forward_batch import KVCache
from armillary.kernels import attention as attn
from armillary.layers.quantization.kv_cache import apply_kv_scales, fp8_kv_layout, high_precision_layers

GDN = Recurrent(((8, 3),), (None,))
ATT = FullAttention(2, 16)
LAYOUT = [GDN, GDN, GDN, ATT, GDN, GDN, GDN, ATT, GDN, GDN, GDN, ATT, GDN, GDN, GDN, ATT]  # Qwen3.6: 3 GDN : 1


@pytest.mark.parametrize("setting,want", [("auto", {3, 15}), ("0", set()), ("3", {3, 7, 15}), ("7,11", {7, 11}),
                                          ("11,", {11})])
def test_high_precision_layers(setting, want):
    assert high_precision_layers(LAYOUT, setting) == want
    layout = fp8_kv_layout(LAYOUT, "fp8", setting)
    for i, spec in enumerate(layout):
        if spec is ATT or isinstance(spec, FullAttention):
            assert (spec.kv_dtype is None) == (i in want) and spec.scaled == (i not in want)
        else:
            assert spec is GDN
    assert fp8_kv_layout(LAYOUT, "auto", setting) == LAYOUT


def test_bad_high_precision_layer_is_named():
    with pytest.raises(ValueError, match=r"\[2\]"):
        high_precision_layers(LAYOUT, "2,3")


def _cache(dtype: torch.dtype, scaled: bool, blocks: int = 6, bs: int = 4, hkv: int = 2, d: int = 16) -> KVCache:
    one = torch.ones((), dtype=torch.float32)
    return KVCache(torch.zeros(blocks, bs, hkv, d, dtype=dtype), torch.zeros(blocks, bs, hkv, d, dtype=dtype), 0,
                   one.clone() if scaled else None, one.clone() if scaled else None)


@pytest.mark.parametrize("k_scale", [1.0, 0.05])
def test_fp8_pages_match_bf16_pages(k_scale):
    torch.manual_seed(0)
    lengths = [7, 13]
    q_len = [3, 1]
    tables = torch.tensor([[1, 2, 0, 0], [3, 4, 5, 0]])
    ref, f8 = _cache(torch.bfloat16, False), _cache(torch.float8_e4m3fn, True)
    f8.k_scale.fill_(k_scale)
    f8.v_scale.fill_(0.1)
    for b, n in enumerate(lengths):
        k, v = torch.randn(n, 2, 16), torch.randn(n, 2, 16)
        slots = torch.tensor([int(tables[b, t // 4]) * 4 + t % 4 for t in range(n)])
        attn.write_kv(ref, k, v, slots)
        attn.write_kv(f8, k, v, slots)
    q = torch.randn(sum(q_len), 4, 16, dtype=torch.bfloat16)
    qsl = [0, 3, 4]
    want = attn.paged_attention(q, ref, tables, qsl, lengths, 0.25).float()
    got = attn.paged_attention(q, f8, tables, qsl, lengths, 0.25).float()
    err = ((got - want).norm() / want.norm()).item()
    print(f"fp8 KV relative error {err:.4f}")
    assert err < 0.06  # e4m3 keys and values: 3 mantissa bits (bf16: 7); measured about 0.03
    assert not torch.equal(got, want)
    dec_q = torch.randn(2, 4, 16, dtype=torch.bfloat16)  # one token each: the batched decode path
    want = attn.paged_attention(dec_q, ref, tables, [0, 1, 2], lengths, 0.25).float()
    got = attn.paged_attention(dec_q, f8, tables, [0, 1, 2], lengths, 0.25).float()
    assert ((got - want).norm() / want.norm()).item() < 0.06


def test_checkpoint_scales_fill_scaled_layers_only():
    model = torch.nn.Module()
    model.checkpoint_kv_scales = {1: {"k": 0.5, "v": 0.25}, 0: {"k": 9.0, "v": 9.0}}
    caches = [_cache(torch.bfloat16, False), _cache(torch.float8_e4m3fn, True), None]
    assert apply_kv_scales(caches, model) == "checkpoint"
    assert caches[1].k_scale.item() == 0.5 and caches[1].v_scale.item() == 0.25
    assert caches[0].k_scale is None


def _filled_pair(dtype=torch.float32):
    """The same random K/V in an fp8 cache (Triton store) and a reference fp8 cache (torch store)."""
    from armillary.kernels.triton import kv_cache as tri_store

    torch.manual_seed(4)
    tables = torch.tensor([[1, 2, 0, 0], [3, 4, 5, 0]], dtype=torch.int32)
    lengths = [7, 13]
    ref, tri = _cache(torch.float8_e4m3fn, True), _cache(torch.float8_e4m3fn, True)
    for c in (ref, tri):
        c.k_scale.fill_(0.07)
        c.v_scale.fill_(0.2)
    for b, n in enumerate(lengths):
        k, v = torch.randn(n, 2, 16, dtype=dtype) * 3, torch.randn(n, 2, 16, dtype=dtype)
        slots = torch.tensor([int(tables[b, t // 4]) * 4 + t % 4 for t in range(n)])
        attn.write_kv(ref, k, v, slots)
        tri_store.write_kv_cache(k, v, tri.k, tri.v, slots, tri.k_scale, tri.v_scale)
    return ref, tri, tables, lengths


def test_triton_fp8_store_is_the_reference_store():
    ref, tri, _, _ = _filled_pair()
    assert torch.equal(ref.k.view(torch.uint8), tri.k.view(torch.uint8))
    assert torch.equal(ref.v.view(torch.uint8), tri.v.view(torch.uint8))


def test_triton_qk_norm_rope_store_fp8():
    from armillary.kernels import reference
    from armillary.kernels.triton import qk_norm_rope

    torch.manual_seed(5)
    t = 5
    q, k, v = torch.randn(t, 4, 16), torch.randn(t, 2, 16) * 2, torch.randn(t, 2, 16)
    w = torch.randn(16) * 0.1
    cos, sin = torch.rand(t, 4), torch.rand(t, 4)
    slots = torch.tensor([4, 5, 6, 9, 13])
    ref, tri = _cache(torch.float8_e4m3fn, True), _cache(torch.float8_e4m3fn, True)
    for c in (ref, tri):
        c.k_scale.fill_(0.03)
        c.v_scale.fill_(0.5)

    class Batch:  # the one field the reference store reads
        def slot_mapping_of(self, cache):
            return slots

    want_q = reference.qk_norm_rope_store(q, k, v, w, w, 1e-6, cos, sin, ref, Batch(), True)
    got_q = qk_norm_rope.qk_norm_rope_store(q, k, v, w, w, 1e-6, cos, sin, tri.k, tri.v, slots, True,
                                            k_scale=tri.k_scale, v_scale=tri.v_scale)
    assert torch.allclose(got_q, want_q, atol=1e-5)
    mismatch = (ref.k.view(torch.uint8) != tri.k.view(torch.uint8)).float().mean().item()
    assert mismatch < 0.01  # the fused norm rounds like the unfused one up to an fp32 ulp at an e4m3 tie
    assert torch.equal(ref.v.view(torch.uint8), tri.v.view(torch.uint8))


@pytest.mark.parametrize("decode", [True, False])
def test_triton_paged_attention_reads_fp8_pages(decode):
    from armillary.kernels.triton import paged_attention as tri_attn

    ref, tri, tables, lengths = _filled_pair()
    if decode:
        q = torch.randn(2, 4, 16)
        want = attn.paged_attention(q, ref, tables, [0, 1, 2], lengths, 0.25)
        got = tri_attn.paged_attention_decode(q, tri.k, tri.v, tables, torch.tensor(lengths, dtype=torch.int32),
                                              0.25, k_scale=tri.k_scale, v_scale=tri.v_scale)
    else:
        q = torch.randn(4, 4, 16)
        qsl = [0, 3, 4]
        want = attn.paged_attention(q, ref, tables, qsl, lengths, 0.25)
        got = tri_attn.paged_attention_prefill(q, tri.k, tri.v, tables, torch.tensor(qsl, dtype=torch.int32),
                                               torch.tensor(lengths, dtype=torch.int32), 3, 0.25,
                                               k_scale=tri.k_scale, v_scale=tri.v_scale)
    assert ((got - want).norm() / want.norm()).item() < 1e-5
