"""The absorbed MLA query in Triton: q_nope through each head's ``W_UK`` into the latent space, optionally in
the same launch as the rope / norm / latent store of ``rope_store`` (one launch per decode layer for both).

q_lat[t, h] = q_nope[t, h] · W_UK[h] with W_UK [H, nope, Dl] (a view of ``kv_b_proj.weight``: per head
its ``nope`` key rows). A program takes one head, one block of latent columns and one block of rows
(decode: at most a few dozen), so the weight (H · nope · Dl values) streams once over many SMs; one
row accumulates with multiply-adds, more rows through ``tl.dot`` (rows padded to 16). The fused launch
appends one program per token that runs ``rope_store_token``: it only touches q's rope dims, the
absorb programs only its nope dims. Grid and buffers follow host shapes: CUDA-graph safe.
Same math as ``naive.absorb_query`` (fp32 accumulation, rounded to q's dtype).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from armillary.kernels.triton.host import cdiv, next_power_of_2
from armillary.kernels.tuning import kernel_config
from armillary_glm_flash.ops.mla.rope_store import check_rope_store, rope_store_meta, rope_store_token

PACKAGE = "armillary_glm_flash"
DEFAULTS = {"BLOCK_D": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2}


@triton.jit
def _mla_absorb_kernel(
    q_ptr, w_ptr, out_ptr, ckv_ptr, norm_w_ptr, cos_ptr, sin_ptr, slots_ptr, kv_ptr,
    rows, num_heads, absorb_programs, stride_qt, stride_qh, stride_wh, stride_wk, stride_ot, stride_oh,
    stride_ct, stride_cs, stride_kv, eps,
    NOPE: tl.constexpr, DL: tl.constexpr, DR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, STORE: tl.constexpr,
    BLOCK_DL: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr,
):
    """Grid (absorb_programs [+ T with STORE],): program p < absorb_programs is (head, row block, column block)."""
    pid = tl.program_id(0)
    if pid < absorb_programs:
        d_blocks = tl.cdiv(DL, BLOCK_D)
        per_head = d_blocks * tl.cdiv(rows, BLOCK_M)
        h = pid // per_head
        mb = (pid % per_head) // d_blocks
        offs_d = (pid % d_blocks) * BLOCK_D + tl.arange(0, BLOCK_D)
        offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        d_ok = offs_d < DL
        m_ok = offs_m < rows
        x_rows = q_ptr + offs_m[:, None].to(tl.int64) * stride_qt + h * stride_qh  # [BM, 1]
        w_head = w_ptr + h.to(tl.int64) * stride_wh
        if USE_DOT:
            acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        else:
            wide = tl.zeros([BLOCK_K, BLOCK_D], dtype=tl.float32)
        for k0 in range(0, NOPE, BLOCK_K):
            k = k0 + offs_k
            k_ok = k < NOPE
            x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
            w = tl.load(w_head + k[:, None] * stride_wk + offs_d[None, :], mask=k_ok[:, None] & d_ok[None, :],
                        other=0.0)  # [BK, BD]
            if USE_DOT:
                acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
            else:  # one row: products per lane, one reduction at the end
                wide += tl.trans(x.to(tl.float32)) * w.to(tl.float32)
        if not USE_DOT:
            acc = tl.sum(wide, axis=0)[None, :]  # [1, BD]
        out = out_ptr + offs_m[:, None].to(tl.int64) * stride_ot + h * stride_oh + offs_d[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
    elif STORE:
        rope_store_token(pid - absorb_programs, q_ptr, ckv_ptr, norm_w_ptr, cos_ptr, sin_ptr, slots_ptr, kv_ptr,
                         stride_qt, stride_qh, stride_ct, stride_cs, stride_kv, num_heads, eps,
                         NOPE, DL, DR, BLOCK_DL, BLOCK_HALF, BLOCK_H, INTERLEAVED)


def absorb_config(num_heads: int, nope: int, kv_lora_rank: int, rows: int, device: torch.device) -> dict:
    """Launch config: defaults, then the tuning tables' ``mla_absorb`` entry for this head count, widths and
    rows (rounded up to a power of two)."""
    key = f"h{num_heads}_n{nope}_d{kv_lora_rank}_m{next_power_of_2(max(rows, 1))}"
    return kernel_config(PACKAGE, "mla_absorb", key, DEFAULTS, device)


def _launch(q: torch.Tensor, w_uk: torch.Tensor, nope: int, store: tuple | None, config: dict | None) -> torch.Tensor:
    rows, heads, _ = q.shape
    dl = w_uk.shape[2]
    if w_uk.shape[:2] != (heads, nope) or w_uk.stride(2) != 1 or q.stride(2) != 1:
        raise ValueError(f"mla_absorb: q {tuple(q.shape)} / W_UK {tuple(w_uk.shape)} do not fit (unit last strides)")
    if w_uk.dtype != q.dtype:
        raise ValueError(f"mla_absorb: W_UK {w_uk.dtype} and q {q.dtype} differ")
    out = q.new_empty(rows, heads, dl)  # [T, H, Dl]
    if rows == 0:
        return out
    cfg = dict(absorb_config(heads, nope, dl, rows, q.device) if config is None else config)
    use_dot = rows > 1
    block_m = 16 if use_dot else 1  # tl.dot needs 16 rows
    block_k = min(cfg["BLOCK_K"], max(16, next_power_of_2(nope)))
    block_d = min(cfg["BLOCK_D"], next_power_of_2(dl))
    programs = heads * cdiv(rows, block_m) * cdiv(dl, block_d)
    if store is None:  # absorb only: the store arguments are placeholders the kernel never reads
        ckv = norm_w = cos = sin = slots = kv = q
        strides, eps, interleaved, meta = (0, 0, 0), 0.0, False, dict(DR=0, BLOCK_DL=1, BLOCK_HALF=1, BLOCK_H=1)
        extra = 0
    else:
        ckv, norm_w, eps, cos, sin, kv, slots, interleaved = store
        dl_cache, dr = check_rope_store(q, ckv, norm_w, cos, sin, kv)
        if dl_cache != dl or q.shape[2] != nope + dr:
            raise ValueError(f"mla_absorb: the cache's latent {dl_cache} + rope {dr} and q / W_UK disagree")
        meta = rope_store_meta(q, dl, dr)
        meta.pop("NOPE"), meta.pop("DL")
        strides, extra = (ckv.stride(0), cos.stride(0), kv.stride(1)), rows
    _mla_absorb_kernel[(programs + extra,)](
        q, w_uk, out, ckv, norm_w, cos, sin, slots, kv, rows, heads, programs, q.stride(0), q.stride(1),
        w_uk.stride(0), w_uk.stride(1), out.stride(0), out.stride(1), *strides, float(eps),
        NOPE=nope, DL=dl, BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_D=block_d, USE_DOT=use_dot,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", STORE=store is not None,
        INTERLEAVED=interleaved, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **meta,
    )
    return out


def mla_absorb(q_nope: torch.Tensor, w_uk: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """q_nope [T, H, nope] (unit last stride, any row / head strides) · W_UK [H, nope, Dl] -> q_lat [T, H, Dl]."""
    return _launch(q_nope, w_uk, q_nope.shape[2], None, config)


def mla_absorb_rope_store(q: torch.Tensor, w_uk: torch.Tensor, ckv: torch.Tensor, weight: torch.Tensor, eps: float,
                          cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor, slot_mapping: torch.Tensor,
                          interleaved: bool, config: dict | None = None) -> torch.Tensor:
    """``rope_store.mla_rope_store`` (q's rope dims rotated in place, the latents stored) and ``mla_absorb`` of
    q's nope dims in one launch. q [T, H, nope + Dr]; the rest as ``mla_rope_store``. Returns q_lat [T, H, Dl]."""
    return _launch(q, w_uk, w_uk.shape[1], (ckv, weight, eps, cos, sin, kv, slot_mapping, interleaved), config)
