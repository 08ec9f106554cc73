"""The absorbed MLA output in Triton: the decode kernel's split partials combined and taken through each head's
``W_UV`` in one launch, written straight in ``o_proj``'s input layout [B, H · v].

out[b, h] = combine_s(part[b, h, s]) · W_UV[h]ᵀ with W_UV [H, v, Dl] (a view of ``kv_b_proj.weight``:
per head its ``v`` value rows). A program takes one head, one block of value columns and one block of
rows: it recombines those rows' latent output from the partials (weights 2^(lse_s − max), only the
splits the decode launch gave keys to, read as one [rows, splits, k] tile per K step), rounds it to
the model dtype as ``mla_decode`` would, and multiplies by its [BLOCK_V, Dl] slice of W_UV (one row:
multiply-adds; more: ``tl.dot`` on rows padded to 16). Without splits it reads the decode kernel's
normalised output instead. This replaces the combine launch, the per-head ``bmm`` and the copy into
``o_proj``'s layout. Grid and buffers follow host shapes: CUDA-graph safe.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from armillary.kernels.triton.host import cdiv, next_power_of_2
from armillary.kernels.tuning import kernel_config
from armillary_glm_flash.ops.mla.decode import Partials, decode_partials, live_splits, mla_decode
from armillary_glm_flash.ops.mla.naive import expand_values

PACKAGE = "armillary_glm_flash"
# use: this fused combine + W_UV launch, else mla_decode then a per-head bmm (the sm_90 table keeps it where the
# H200 timed it faster: batch 1, 1.08x; at 8 rows it was 0.38x of the bmm path)
DEFAULTS = {"BLOCK_V": 64, "tile_elements": 8192, "num_warps": 4, "num_stages": 2, "use": True}


@triton.jit
def _mla_expand_kernel(
    lat_ptr, part_ptr, lse_ptr, seq_lens_ptr, w_ptr, out_ptr,
    rows, num_heads, num_splits, min_tiles, split_block_n, stride_lb, stride_lh, stride_wh, stride_wv, stride_ob,
    DL: tl.constexpr, V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_S: tl.constexpr, SPLIT: tl.constexpr, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Grid (H · value blocks, row blocks). part [B, H, S, DL] / lse [B, H, S] float32 with SPLIT, else
    lat [B, H, DL]; out [B, H · V] in the weight's dtype."""
    pid = tl.program_id(0)
    v_blocks = tl.cdiv(V, BLOCK_V)
    h = pid // v_blocks
    offs_v = (pid % v_blocks) * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    v_ok = offs_v < V
    m_ok = offs_m < rows
    if SPLIT:
        s = tl.arange(0, BLOCK_S)
        # the splits the decode launch gave keys to, from each row's length (as its split kernel derives them)
        seq = tl.load(seq_lens_ptr + offs_m, mask=m_ok, other=0)
        active = live_splits(seq, num_splits, min_tiles, split_block_n)  # [BM]; the rest were never written
        live = m_ok[:, None] & (s[None, :] < active[:, None])  # [BM, BS]
        base = (offs_m.to(tl.int64) * num_heads + h) * num_splits  # [BM] rows of [B, H, S]
        lse = tl.load(lse_ptr + base[:, None] + s[None, :], mask=live, other=float("-inf"))
        top = tl.max(lse, 1)
        top = tl.where(top == float("-inf"), 0.0, top)  # no keys: all weights 0, output 0
        weights = tl.exp2(lse - top[:, None])  # [BM, BS]
        denom = tl.sum(weights, 1)
        weights = weights / tl.where(denom == 0.0, 1.0, denom)[:, None]
        part_rows = part_ptr + (base[:, None] + s[None, :]) * DL  # [BM, BS]
    w_head = w_ptr + h.to(tl.int64) * stride_wh + offs_v[:, None] * stride_wv  # [BV, 1]
    if USE_DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)
    else:
        wide = tl.zeros([BLOCK_V, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, DL, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < DL
        if SPLIT:
            parts = tl.load(part_rows[:, :, None] + k[None, None, :], mask=live[:, :, None] & k_ok[None, None, :],
                            other=0.0)  # [BM, BS, BK]
            x = tl.sum(parts * weights[:, :, None], 1).to(w_ptr.dtype.element_ty)  # [BM, BK], mla_decode's rounding
        else:
            x = tl.load(lat_ptr + offs_m[:, None].to(tl.int64) * stride_lb + h * stride_lh + k[None, :],
                        mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_head + k[None, :], mask=v_ok[:, None] & k_ok[None, :], other=0.0)  # [BV, BK]
        if USE_DOT:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        else:  # one row: products per lane, one reduction at the end
            wide += w.to(tl.float32) * x.to(tl.float32)
    if not USE_DOT:
        acc = tl.sum(wide, axis=1)[None, :]  # [1, BV]
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_ob + h * V + offs_v[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & v_ok[None, :])


def expand_config(num_heads: int, v_dim: int, kv_lora_rank: int, rows: int, device: torch.device) -> dict:
    """Launch config: defaults, then the tuning tables' ``mla_expand`` entry for this head count, widths and
    rows (rounded up to a power of two)."""
    key = f"h{num_heads}_v{v_dim}_d{kv_lora_rank}_m{next_power_of_2(max(rows, 1))}"
    return kernel_config(PACKAGE, "mla_expand", key, DEFAULTS, device)


def mla_expand(w_uv: torch.Tensor, rows: int, lat: torch.Tensor | None = None, partials: Partials | None = None,
               seq_lens: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """[rows, H · v] = (the latent output) · W_UV[h]ᵀ per head, W_UV [H, v, Dl] (unit last stride).

    The latent output is ``lat`` [rows, H, Dl] (unit last stride, W_UV's dtype), or the combination of
    ``decode.decode_partials``' split partials (``partials`` with more than one split, and the launch's
    ``seq_lens``, which say the splits holding keys)."""
    heads, v_dim, dl = w_uv.shape
    if w_uv.stride(2) != 1:
        raise ValueError("mla_expand: W_UV needs a unit last stride")
    split = partials is not None
    if split:
        part_out, part_lse = partials.part_out, partials.part_lse
        if partials.splits < 2 or part_out.shape != (rows, heads, partials.splits, dl) or seq_lens is None:
            raise ValueError(f"mla_expand: partials {tuple(part_out.shape)} do not fit W_UV {tuple(w_uv.shape)} "
                             "(more than one split, with the launch's seq_lens)")
        splits, min_tiles, block_n = partials.splits, partials.min_tiles, partials.block_n
        lat = part_out  # placeholder: not read with SPLIT
    else:
        if lat is None or lat.shape != (rows, heads, dl) or lat.stride(2) != 1 or lat.dtype != w_uv.dtype:
            raise ValueError(f"mla_expand: latents {None if lat is None else tuple(lat.shape)} do not fit W_UV "
                             f"{tuple(w_uv.shape)} (unit last stride, W_UV's dtype)")
        splits, min_tiles, block_n, part_out, part_lse, seq_lens = 1, 1, 1, lat, lat, lat
    out = torch.empty(rows, heads * v_dim, dtype=w_uv.dtype, device=w_uv.device)
    if rows == 0:
        return out
    cfg = dict(expand_config(heads, v_dim, dl, rows, w_uv.device) if config is None else config)
    use_dot = rows > 1
    block_m = 16 if use_dot else 1  # tl.dot needs 16 rows
    block_s = next_power_of_2(splits) if split else 1
    block_v = min(cfg["BLOCK_V"], max(16, next_power_of_2(v_dim)))
    # K step: the [rows, splits, K] partial tile within ``tile_elements`` values (at least 16: tl.dot)
    block_k = next_power_of_2(max(16, cfg["tile_elements"] // (block_m * block_s)))
    block_k = min(block_k, max(16, next_power_of_2(dl)))
    grid = (heads * cdiv(v_dim, block_v), cdiv(rows, block_m))
    _mla_expand_kernel[grid](
        lat, part_out, part_lse, seq_lens, w_uv, out, rows, heads, splits, min_tiles, block_n,
        lat.stride(0), lat.stride(1), w_uv.stride(0), w_uv.stride(1), out.stride(0),
        DL=dl, V=v_dim, BLOCK_M=block_m, BLOCK_V=block_v, BLOCK_K=block_k, BLOCK_S=block_s, SPLIT=split,
        USE_DOT=use_dot, DOT_PRECISION="ieee" if w_uv.dtype == torch.float32 else "tf32",
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out


def mla_decode_values(q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, scale: float, max_seq_len: int, w_uv: torch.Tensor,
                      decode_cfg: dict | None = None, expand_cfg: dict | None = None,
                      num_splits: int | None = None) -> torch.Tensor:
    """The absorbed decode through W_UV: ``decode.mla_decode`` (arguments as there) then ``mla_expand``, two
    launches. Returns [B, H · v] in q_lat's dtype, ``o_proj``'s input."""
    cfg = expand_cfg if expand_cfg is not None else expand_config(q_lat.shape[1], w_uv.shape[1], q_lat.shape[2],
                                                                  q_lat.shape[0], q_lat.device)
    if not cfg.get("use", True):
        out_lat = mla_decode(q_lat, q_pe, kv, block_tables, seq_lens, scale, max_seq_len, decode_cfg, num_splits)
        return expand_values(out_lat, w_uv).reshape(q_lat.shape[0], -1)
    p = decode_partials(q_lat, q_pe, kv, block_tables, seq_lens, scale, max_seq_len, decode_cfg, num_splits)
    expand_cfg = cfg
    if p.splits > 1:
        return mla_expand(w_uv, q_lat.shape[0], partials=p, seq_lens=seq_lens, config=expand_cfg)
    return mla_expand(w_uv, q_lat.shape[0], lat=p.out, config=expand_cfg)
