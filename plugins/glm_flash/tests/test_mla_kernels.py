"""The absorbed paged MLA decode (Triton kernel and torch reference) against the decompressed MLA reference
(keys and values expanded through ``kv_b_proj``, as transformers computes them), at odd sizes."""
from __future__ import annotations

import pytest
import torch

from armillary_glm_flash.ops.mla.decode import mla_decode
from armillary_glm_flash.ops.mla.naive import (
    absorb_query,
    expand_values,
    gather_latent,
    mla_decode_ref,
    mla_decompressed_ref,
    rope_store_ref,
    write_latent,
)
from armillary_glm_flash.ops.mla.rope_store import mla_rope_store
from armillary_glm_flash.ops.mla.prefill import decompressed_attention, expanded_keys

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the CPU runs Triton's interpreter


def _paged_case(seq_lens: list[int], heads: int, dl: int, dr: int, nope: int, v: int, page: int,
                dtype: torch.dtype, seed: int = 0):
    """Random latents written into a shuffled paged cache, queries, kv_b weights."""
    g = torch.Generator().manual_seed(seed)
    batch = len(seq_lens)
    max_blocks = max(1, -(-max(seq_lens) // page))
    num_blocks = batch * max_blocks + 1
    kv = torch.zeros(num_blocks, page, dl + dr, dtype=dtype)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1)[: batch * max_blocks]
    tables = perm.view(batch, max_blocks).to(torch.int32)
    latents, pes = [], []
    for b, n in enumerate(seq_lens):
        lat = torch.randn(n, dl, generator=g).to(dtype)
        pe = torch.randn(n, dr, generator=g).to(dtype)
        pos = torch.arange(n)
        slots = tables[b, pos // page].long() * page + pos % page
        write_latent(kv, lat, pe, slots)
        latents.append(lat)
        pes.append(pe)
    q_nope = torch.randn(batch, heads, nope, generator=g).to(dtype)
    q_pe = torch.randn(batch, heads, dr, generator=g).to(dtype)
    w = (torch.randn(heads * (nope + v), dl, generator=g) * dl ** -0.5).to(dtype)
    on = [t.to(DEVICE) for t in (kv, tables, q_nope, q_pe, w)]
    return on[0], on[1], [x.to(DEVICE) for x in latents], [x.to(DEVICE) for x in pes], on[2], on[3], on[4]


def _expected(latents, pes, q_nope, q_pe, w, scale) -> torch.Tensor:
    rows = []
    for b, (lat, pe) in enumerate(zip(latents, pes)):
        if lat.shape[0] == 0:
            rows.append(q_nope.new_zeros(q_nope.shape[1], w.shape[0] // q_nope.shape[1] - q_nope.shape[2]).float())
            continue
        rows.append(mla_decompressed_ref(q_nope[b:b + 1], q_pe[b:b + 1], lat, pe, w, scale)[0])
    return torch.stack(rows)  # [B, H, v]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6)).item()


CASES = [  # seq_lens, heads, kv_lora_rank, rope, nope, v, page
    ([1, 17, 45], 5, 40, 12, 20, 28, 8),
    ([3, 70], 20, 24, 10, 12, 16, 16),  # more heads than one 16-row head block at BLOCK_H 16
    ([0, 33, 9, 1], 3, 36, 18, 16, 20, 4),  # a padded row (seq_len 0) gives zeros
]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter evaluates masked-off lanes too
@pytest.mark.parametrize("case", CASES, ids=["b3h5", "b2h20", "padded"])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_absorbed_decode_matches_decompressed_reference(case, splits):
    seq_lens, heads, dl, dr, nope, v, page = case
    kv, tables, latents, pes, q_nope, q_pe, w = _paged_case(seq_lens, heads, dl, dr, nope, v, page, torch.float32)
    scale = (nope + dr) ** -0.5
    want = _expected(latents, pes, q_nope, q_pe, w, scale)
    w_heads = w.view(heads, nope + v, dl)
    q_lat = absorb_query(q_nope, w_heads[:, :nope])
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    ref = expand_values(mla_decode_ref(q_lat, q_pe, kv, tables, lens, scale, max(seq_lens)), w_heads[:, nope:])
    assert _rel(ref, want) < 1e-5
    got_lat = mla_decode(q_lat, q_pe, kv, tables, lens, scale, max(seq_lens), num_splits=splits)
    got = expand_values(got_lat, w_heads[:, nope:])
    assert _rel(got, want) < 1e-5, f"relative error {_rel(got, want):.2e}"
    empty = lens == 0
    assert torch.equal(got_lat[empty], torch.zeros_like(got_lat[empty]))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_absorbed_decode_half_and_config_overrides():
    """Half-precision inputs (fp32 accumulation) within their rounding, for several tile shapes. fp16 on the
    CPU: the Triton interpreter's bf16 ``tl.dot`` is wrong (bench/glm_flash_gpu_checks.py covers bf16)."""
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float16
    seq_lens, heads, dl, dr, nope, v, page = [5, 64, 37], 4, 32, 16, 24, 24, 16
    kv, tables, latents, pes, q_nope, q_pe, w = _paged_case(seq_lens, heads, dl, dr, nope, v, page, dtype)
    scale = (nope + dr) ** -0.5
    want = _expected([x.float() for x in latents], [x.float() for x in pes], q_nope.float(), q_pe.float(),
                     w.float(), scale)
    w_heads = w.view(heads, nope + v, dl)
    q_lat = absorb_query(q_nope, w_heads[:, :nope])
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    for cfg in ({"BLOCK_H": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "split_min_tokens": 16,
                 "target_waves": 4},
                {"BLOCK_H": 32, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2, "split_min_tokens": 128,
                 "target_waves": 1}):
        got = expand_values(mla_decode(q_lat, q_pe, kv, tables, lens, scale, 64, config=cfg), w_heads[:, nope:])
        assert got.dtype == dtype
        assert _rel(got, want) < (3e-2 if dtype == torch.bfloat16 else 5e-3), f"{cfg}: relative error {_rel(got, want):.2e}"


def test_decompressed_prefill_after_cached_context():
    """A chunk of 5 queries after 11 cached tokens: the expanded-key path equals the naive reference."""
    heads, dl, dr, nope, v = 3, 20, 6, 10, 14
    kv, tables, latents, pes, _, _, w = _paged_case([16], heads, dl, dr, nope, v, 4, torch.float32, seed=3)
    g = torch.Generator().manual_seed(5)
    q_nope = torch.randn(5, heads, nope, generator=g).to(DEVICE)
    q_pe = torch.randn(5, heads, dr, generator=g).to(DEVICE)
    rows = gather_latent(kv, tables[0], 16)
    assert torch.equal(rows[:, :dl], latents[0]) and torch.equal(rows[:, dl:], pes[0])
    expanded = (rows[:, :dl] @ w.T).view(16, heads, nope + v)
    k, vals = expanded_keys(expanded, rows[:, dl:], nope)
    got = decompressed_attention(torch.cat((q_nope, q_pe), -1), k, vals, 11, 0.2)
    want = mla_decompressed_ref(q_nope, q_pe, latents[0], pes[0], w, 0.2)
    assert _rel(got, want) < 1e-5


@pytest.mark.parametrize("length", [1, 17, 40])
def test_expanded_keys_kernel_equals_copies(length):
    """The one-pass key kernel writes the same keys as the two torch copies, from kv_b_proj's head-major rows and
    strided rope-key rows (the gathered cache's tail)."""
    g = torch.Generator().manual_seed(length)
    heads, nope, v, dr = 3, 24, 20, 10
    kv = torch.randn(length, heads * (nope + v), generator=g).to(DEVICE).view(length, heads, nope + v)
    rows = torch.randn(length, 36 + dr, generator=g).to(DEVICE)
    k_pe = rows[:, 36:]  # a strided view, as the model passes it
    want, want_v = expanded_keys(kv, k_pe, nope, triton_kernel=False)
    got, got_v = expanded_keys(kv, k_pe, nope, triton_kernel=True)
    assert torch.equal(got, want) and got.is_contiguous()
    assert torch.equal(got_v, want_v) and got_v.data_ptr() == kv[..., nope:].data_ptr()


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "neox"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_t", [2, 8], ids=["tiles-of-2", "one-tile"])
def test_rope_store_matches_reference(interleaved, dtype, block_t):
    """Norm + rotary + latent store (and q's rope dims in place) in one launch equals the unfused reference,
    with 7 tokens in one program or in four (the last one partly masked)."""
    g = torch.Generator().manual_seed(11)
    tokens, heads, nope, dl, dr, page = 7, 5, 20, 44, 12, 4
    ckv = torch.randn(tokens, dl + dr + 3, generator=g)[:, : dl + dr].to(dtype).to(DEVICE)  # strided rows
    q = torch.randn(tokens, heads, nope + dr, generator=g).to(dtype).to(DEVICE)
    weight = (1 + 0.3 * torch.randn(dl, generator=g)).to(dtype).to(DEVICE)
    angles = torch.rand(tokens, dr // 2, generator=g).to(DEVICE) * 6
    cos, sin = angles.cos(), angles.sin()
    slots = torch.tensor([9, 2, 17, 4, 30, 11, 0]).to(DEVICE)
    kv_ref, kv = (torch.full((8, page, dl + dr), 7.0, dtype=dtype, device=DEVICE) for _ in range(2))
    q_ref = q.clone()
    rope_store_ref(q_ref, ckv, weight, 1e-6, cos, sin, kv_ref, slots, interleaved)
    mla_rope_store(q, ckv, weight, 1e-6, cos, sin, kv, slots, interleaved, block_t=block_t)
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    assert torch.allclose(kv.float(), kv_ref.float(), atol=tol, rtol=tol)
    assert torch.allclose(q.float(), q_ref.float(), atol=tol, rtol=tol)
    assert torch.equal(q[..., :nope], q_ref[..., :nope])  # the nope dims are never touched
    untouched = torch.ones(8 * page, dtype=torch.bool)
    untouched[slots.cpu()] = False
    assert (kv.view(8 * page, -1)[untouched.to(DEVICE)] == 7).all()


def test_decode_launches_fit_sm90_shared_memory():
    """The decode kernel's default and largest swept config, and the absorb / expand / router launches at 1, 8
    and 64 rows (router_topk and the table's norm_gemv at 1 and 8), compiled offline for sm_90 (no GPU): each
    within its shared memory."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("mla_smem.py")
    proc = subprocess.run([sys.executable, str(script)], cwd=script.parents[3], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {r["kernel"] for r in rows} == {"_mla_decode_split_kernel", "_mla_combine_kernel", "_mla_absorb_kernel",
                                          "_mla_expand_kernel", "_router_logits_kernel", "_router_topk_kernel",
                                          "_norm_gemv_kernel"}
    for r in rows:
        assert r["shared"] <= r["limit"], r
    assert max(r["shared"] for r in rows) > 0  # the split kernel stages its tiles in shared memory
