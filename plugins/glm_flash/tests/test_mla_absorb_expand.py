"""The decode step's Triton kernels around the MLA attention, at odd sizes, against their float32 references:
q through W_UK (alone and fused with the rope / norm / latent store), the split partials combined and taken
through W_UV into o_proj's layout, and the router's float32 logits."""
from __future__ import annotations

import pytest
import torch

from armillary_glm_flash.ops.mla.absorb import mla_absorb, mla_absorb_rope_store
from armillary_glm_flash.ops.mla.decode import decode_partials, mla_decode
from armillary_glm_flash.ops.mla.expand import mla_decode_values, mla_expand
from armillary_glm_flash.ops.mla.naive import absorb_query, expand_values, mla_decode_ref, rope_store_ref
from armillary_glm_flash.ops.router import router_logits, router_logits_mma, router_logits_ref
from plugins.glm_flash.tests.test_mla_kernels import DEVICE, _expected, _paged_case, _rel

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter evaluates masked-off lanes
HALF = torch.bfloat16 if torch.cuda.is_available() else torch.float16  # the interpreter's bf16 tl.dot is wrong


def _absorb_ref(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    return absorb_query(q_nope.float(), w_uk.float())  # [T, H, Dl] float32


@pytest.mark.parametrize("rows", [1, 3, 19], ids=["one-row", "dot", "two-row-blocks"])
@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_absorb_matches_reference(rows, dtype):
    g = torch.Generator().manual_seed(rows)
    heads, nope, dr, v, dl = 5, 20, 12, 28, 40
    q = torch.randn(rows, heads, nope + dr, generator=g).to(dtype).to(DEVICE)  # q_nope: a strided view of it
    w = (torch.randn(heads * (nope + v), dl, generator=g) * nope ** -0.5).to(dtype).to(DEVICE)
    w_uk = w.view(heads, nope + v, dl)[:, :nope]  # kv_b_proj's per-head key rows, as the model passes them
    want = _absorb_ref(q[..., :nope], w_uk)
    for cfg in (None, {"BLOCK_D": 16, "BLOCK_K": 16, "num_warps": 2, "num_stages": 1}):
        got = mla_absorb(q[..., :nope], w_uk, config=cfg)
        assert got.shape == (rows, heads, dl) and got.dtype == dtype
        assert _rel(got, want) < (1e-6 if dtype == torch.float32 else 3e-3), f"{cfg}: {_rel(got, want):.2e}"


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "neox"])
@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_absorb_fused_with_rope_store(interleaved, dtype):
    """One launch: the same cache rows and rotated q as ``rope_store_ref``, the same q_lat as absorbing after it."""
    g = torch.Generator().manual_seed(7)
    tokens, heads, nope, dl, dr, v, page = 6, 3, 24, 36, 10, 20, 4
    ckv = torch.randn(tokens, dl + dr + 5, generator=g)[:, : dl + dr].to(dtype).to(DEVICE)  # strided rows
    q = torch.randn(tokens, heads, nope + dr, generator=g).to(dtype).to(DEVICE)
    norm_w = (1 + 0.3 * torch.randn(dl, generator=g)).to(dtype).to(DEVICE)
    w_uk = (torch.randn(heads, nope + v, dl, generator=g) * nope ** -0.5).to(dtype).to(DEVICE)[:, :nope]
    angles = torch.rand(tokens, dr // 2, generator=g).to(DEVICE) * 6
    cos, sin = angles.cos(), angles.sin()
    slots = torch.tensor([5, 0, 13, 2, 30, 8]).to(DEVICE)
    kv_ref, kv = (torch.full((8, page, dl + dr), 3.0, dtype=dtype, device=DEVICE) for _ in range(2))
    q_ref = q.clone()
    rope_store_ref(q_ref, ckv, norm_w, 1e-6, cos, sin, kv_ref, slots, interleaved)
    want = _absorb_ref(q_ref[..., :nope], w_uk)
    got = mla_absorb_rope_store(q, w_uk, ckv, norm_w, 1e-6, cos, sin, kv, slots, interleaved)
    tol = 1e-6 if dtype == torch.float32 else 3e-3
    assert torch.allclose(kv.float(), kv_ref.float(), atol=tol, rtol=tol)
    assert torch.allclose(q.float(), q_ref.float(), atol=tol, rtol=tol)
    assert torch.equal(q[..., :nope], q_ref[..., :nope])  # the absorb programs only read the nope dims
    assert _rel(got, want) < tol


CASES = [  # seq_lens, heads, kv_lora_rank, rope, nope, v, page
    ([1, 17, 45], 5, 40, 12, 20, 28, 8),
    ([0, 33, 9, 1], 3, 36, 18, 16, 20, 4),  # a padded row (seq_len 0) gives zeros
    ([70], 4, 24, 10, 12, 44, 16),  # one row: the multiply-add path
    ([2] * 18, 2, 20, 8, 12, 16, 8),  # two row blocks
]


@pytest.mark.parametrize("case", CASES, ids=["b3", "padded", "b1", "b18"])
@pytest.mark.parametrize("splits", [1, 3, 16], ids=["one-split", "splits", "mostly-empty-splits"])
def test_decode_values_match_decompressed_reference(case, splits):
    """Split partials combined and expanded in one launch == the decompressed MLA (keys / values expanded)."""
    seq_lens, heads, dl, dr, nope, v, page = case
    kv, tables, latents, pes, q_nope, q_pe, w = _paged_case(seq_lens, heads, dl, dr, nope, v, page, torch.float32)
    scale = (nope + dr) ** -0.5
    want = _expected(latents, pes, q_nope, q_pe, w, scale)  # [B, H, v]
    w_heads = w.view(heads, nope + v, dl)
    q_lat = absorb_query(q_nope, w_heads[:, :nope])
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    ref = expand_values(mla_decode_ref(q_lat, q_pe, kv, tables, lens, scale, max(seq_lens)), w_heads[:, nope:])
    assert _rel(ref, want) < 1e-5
    small = {"BLOCK_H": 16, "BLOCK_N": 4, "num_warps": 4, "num_stages": 1, "split_min_tokens": 4, "target_waves": 2}
    for dcfg, cfg in ((None, None), (small, {"BLOCK_V": 16, "tile_elements": 256, "num_warps": 2, "num_stages": 1})):
        got = mla_decode_values(q_lat, q_pe, kv, tables, lens, scale, max(seq_lens), w_heads[:, nope:],
                                decode_cfg=dcfg, expand_cfg=cfg, num_splits=splits)
        assert got.shape == (len(seq_lens), heads * v)
        err = _rel(got.view(-1, heads, v), want)
        assert err < 1e-5, f"{cfg}: relative error {err:.2e}"
        empty = lens == 0
        assert torch.equal(got[empty], torch.zeros_like(got[empty]))


def test_expand_reads_only_the_splits_with_keys(monkeypatch):
    """Partials of splits the decode launch gave no keys are neither written nor read: poisoning them changes
    nothing, in the fused expand and in mla_decode's own combine."""
    seq_lens, heads, dl, dr, nope, v, page = [3, 40], 2, 24, 8, 8, 16, 4
    kv, tables, _, _, q_nope, q_pe, w = _paged_case(seq_lens, heads, dl, dr, nope, v, page, torch.float32, seed=4)
    w_heads = w.view(heads, nope + v, dl)
    q_lat = absorb_query(q_nope, w_heads[:, :nope])
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    cfg = {"BLOCK_H": 16, "BLOCK_N": 4, "num_warps": 4, "num_stages": 1, "split_min_tokens": 4, "target_waves": 4}
    p = decode_partials(q_lat, q_pe, kv, tables, lens, 0.3, 40, cfg, 8)
    clean = mla_expand(w_heads[:, nope:], 2, partials=p, seq_lens=lens)
    # row 0 (3 keys, 1 tile of 4) fills split 0 only; row 1 (40 keys, 10 tiles, 2 a split) fills splits 0..4
    p.part_out[0, :, 1:] = float("nan")
    p.part_out[1, :, 5:] = float("nan")
    p.part_lse[0, :, 1:] = 50.0
    p.part_lse[1, :, 5:] = 50.0
    assert torch.equal(mla_expand(w_heads[:, nope:], 2, partials=p, seq_lens=lens), clean)
    # at least 3 tiles a split (split_live_min_tokens 12): row 1's 10 tiles fill splits 0..3; the split buffers start
    # as NaN partials and a large lse, so a split written or read against the rule would show
    real_empty = torch.empty

    def poisoned_empty(*shape, dtype=None, **kw):
        t = real_empty(*shape, dtype=dtype, **kw)
        if dtype == torch.float32 and len(shape) in (3, 4):
            t.fill_(float("nan") if len(shape) == 4 else 50.0)
        return t

    wide = dict(cfg, split_live_min_tokens=12)
    want = mla_decode_values(q_lat, q_pe, kv, tables, lens, 0.3, 40, w_heads[:, nope:], decode_cfg=wide, num_splits=1)
    want_lat = mla_decode(q_lat, q_pe, kv, tables, lens, 0.3, 40, config=wide, num_splits=1)
    monkeypatch.setattr(torch, "empty", poisoned_empty)
    got = mla_decode_values(q_lat, q_pe, kv, tables, lens, 0.3, 40, w_heads[:, nope:], decode_cfg=wide, num_splits=8)
    got_lat = mla_decode(q_lat, q_pe, kv, tables, lens, 0.3, 40, config=wide, num_splits=8)
    monkeypatch.undo()
    assert _rel(got, want) < 1e-5 and _rel(got_lat, want_lat) < 1e-5


@pytest.mark.parametrize("rows", [1, 3, 9, 64])
@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_router_logits_match_reference(rows, dtype):
    # the same float32 products, summed in another order
    w = _check_router(router_logits, rows, dtype, {"BLOCK_E": 4, "BLOCK_K": 64, "num_warps": 2, "num_stages": 1}, 1e-5)
    with pytest.raises(ValueError, match="rows"):
        router_logits(torch.zeros(65, 203, dtype=dtype, device=DEVICE), w)


def _check_router(fn, rows: int, dtype: torch.dtype, config: dict, tol: float) -> torch.Tensor:
    """``fn``'s float32 logits for x [rows, 203] and W [7, 203], defaults and ``config``, against the reference;
    returns W."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 203, generator=g).to(dtype).to(DEVICE)
    w = torch.randn(7, 203, generator=g).to(DEVICE)
    want = router_logits_ref(x, w)
    for cfg in (None, config):
        got = fn(x, w, config=cfg)
        assert got.dtype == torch.float32 and got.shape == (rows, 7)
        assert _rel(got, want) < tol, cfg
    return w


@pytest.mark.parametrize("rows", [65, 130, 200])
def test_router_logits_mma_match_reference(rows):
    """Prefill rows: the float32 weight split into three half parts, tensor-core dots; float32-close to the GEMM
    (one half part alone is ~1e-3 off: all three count)."""
    cfg = {"min_rows": 1, "BLOCK_T": 16, "BLOCK_K": 32, "num_warps": 2, "num_stages": 1}
    w = _check_router(router_logits_mma, rows, HALF, cfg, 2e-6)
    with pytest.raises(ValueError, match="do not fit"):
        router_logits_mma(torch.zeros(rows, 203, device=DEVICE), w)
