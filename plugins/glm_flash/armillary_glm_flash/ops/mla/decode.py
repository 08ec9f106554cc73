"""Paged MLA decode in Triton, absorbed form: one query per sequence, scores and sum over the cached latents.

Every head reads the same latent row, so a program takes a block of heads (``BLOCK_H``) and one
range of a sequence's keys: each ``[BLOCK_N, Dl + Dr]`` tile of latents is loaded once for all of
them and used twice, in ``q_lat · latentᵀ + q_pe · k_peᵀ`` and in ``p · latent``. Long contexts
are cut into ``num_splits`` key ranges (flash-decoding); a second launch combines their partial
results by their log-sum-exps. The split count is fixed per launch from host ints only (batch
size, ``max_seq_len``) and each program derives its range from the device ``seq_lens`` (at least
``split_live_min_tokens`` keys a split, one tile unless a table says more; the splits left without keys
are neither written nor read), so a CUDA graph captured once serves
every length (no host sync, no ``*_cpu`` field).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

from armillary.kernels.triton.host import cdiv, next_power_of_2
from armillary.kernels.tuning import kernel_config

LOG2E = 1.4426950408889634
MAX_SPLITS = 64
PACKAGE = "armillary_glm_flash"
# split_live_min_tokens: the least keys a split of one sequence takes on the device (one tile by default: the H200
# timed B=1 / 1K context at 21.6 us with 128, against 11.2 us with a tile, so few-key sequences keep every split)
DEFAULTS = {"BLOCK_H": 32, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2, "split_min_tokens": 128,
            "split_live_min_tokens": 0, "target_waves": 2}


@triton.jit
def split_tiles(seq_len, num_splits, min_tiles, block_n):
    """Key tiles per split of a sequence of ``seq_len`` keys (at least ``min_tiles``, itself >= 1)."""
    return tl.maximum(tl.cdiv(tl.cdiv(seq_len, block_n), num_splits), min_tiles)


@triton.jit
def live_splits(seq_len, num_splits, min_tiles, block_n):
    """How many of a sequence's splits hold keys (the first ones; 0 for an empty sequence)."""
    return tl.cdiv(seq_len, split_tiles(seq_len, num_splits, min_tiles, block_n) * block_n)


@triton.jit
def _mla_decode_split_kernel(
    q_lat_ptr, q_pe_ptr, kv_ptr, block_tables_ptr, seq_lens_ptr, part_out_ptr, part_lse_ptr, out_ptr,
    stride_qlb, stride_qlh, stride_qpb, stride_qph, stride_kvb, stride_kvs, stride_bt, stride_ob, stride_oh,
    num_heads, num_splits, min_tiles, scale_log2,
    DL: tl.constexpr, DR: tl.constexpr, BLOCK_DL: tl.constexpr, BLOCK_DR: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid (B, head blocks, splits). Without SPLIT the normalised output goes to ``out`` [B, H, Dl];
    with it, per split holding keys (``live_splits``), the normalised partial to ``part_out`` [B, H, S, Dl]
    (float32) and its log2-sum-exp to ``part_lse`` [B, H, S]; the other splits' rows stay unwritten."""
    b = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    h_ok = heads < num_heads
    dl = tl.arange(0, BLOCK_DL)
    dr = tl.arange(0, BLOCK_DR)
    dl_ok = dl < DL
    dr_ok = dr < DR
    seq_len = tl.load(seq_lens_ptr + b)
    tiles = split_tiles(seq_len, num_splits, min_tiles, BLOCK_N)  # from this sequence's length
    lo = split * tiles * BLOCK_N
    hi = tl.minimum(lo + tiles * BLOCK_N, seq_len)

    q_lat = tl.load(q_lat_ptr + b * stride_qlb + heads[:, None] * stride_qlh + dl[None, :],
                    mask=h_ok[:, None] & dl_ok[None, :], other=0.0)  # [BLOCK_H, BLOCK_DL]
    q_pe = tl.load(q_pe_ptr + b * stride_qpb + heads[:, None] * stride_qph + dr[None, :],
                   mask=h_ok[:, None] & dr_ok[None, :], other=0.0)  # [BLOCK_H, BLOCK_DR]
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DL], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        n_ok = pos < hi
        block = tl.load(block_tables_ptr + b * stride_bt + pos // PAGE, mask=n_ok, other=0)
        rows = kv_ptr + block.to(tl.int64) * stride_kvb + (pos % PAGE) * stride_kvs  # [BLOCK_N] row starts
        latent = tl.load(rows[:, None] + dl[None, :], mask=n_ok[:, None] & dl_ok[None, :], other=0.0)
        k_pe = tl.load(rows[:, None] + DL + dr[None, :], mask=n_ok[:, None] & dr_ok[None, :], other=0.0)
        s = tl.dot(q_lat, tl.trans(latent), input_precision=DOT_PRECISION)
        s += tl.dot(q_pe, tl.trans(k_pe), input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_N]
        s = tl.where(n_ok[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(latent.dtype), latent, input_precision=DOT_PRECISION)
        m_i = m_new
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # an empty range (padding row, empty split) gives zeros
    acc = acc / l_safe[:, None]
    mask = h_ok[:, None] & dl_ok[None, :]
    if SPLIT:
        if lo < seq_len:  # a split without keys writes nothing: the combining launches skip it
            row = (b * num_heads + heads) * num_splits + split  # [BLOCK_H] rows of [B, H, S]
            tl.store(part_out_ptr + row[:, None] * DL + dl[None, :], acc, mask=mask)
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
            tl.store(part_lse_ptr + row, lse, mask=h_ok)
    else:
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + dl[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _mla_combine_kernel(part_out_ptr, part_lse_ptr, seq_lens_ptr, out_ptr, num_heads, num_splits, min_tiles,
                        block_n, stride_ob, stride_oh,
                        DL: tl.constexpr, BLOCK_DL: tl.constexpr, BLOCK_S: tl.constexpr):
    """Grid (B, H): out = Σ_s 2^(lse_s − M) · out_s / Σ_s 2^(lse_s − M) over the splits holding keys."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    dl = tl.arange(0, BLOCK_DL)
    s_ok = s < live_splits(tl.load(seq_lens_ptr + b), num_splits, min_tiles, block_n)
    base = (b * num_heads + h) * num_splits
    lse = tl.load(part_lse_ptr + base + s, mask=s_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # every split empty: all weights 0, output 0
    w = tl.exp2(lse - top)
    denom = tl.sum(w, 0)
    parts = tl.load(part_out_ptr + (base + s)[:, None] * DL + dl[None, :], mask=s_ok[:, None] & (dl < DL)[None, :],
                    other=0.0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + dl, out.to(out_ptr.dtype.element_ty), mask=dl < DL)


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a small stand-in, so CPU tests cover split launches
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


@lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def decode_config(num_heads: int, kv_lora_rank: int, rope_dim: int, device: torch.device) -> dict:
    """Launch config: defaults, then the tuning tables' entry for this head count and latent width."""
    return kernel_config(PACKAGE, "mla_decode", f"h{num_heads}_d{kv_lora_rank}_r{rope_dim}", DEFAULTS, device)


def num_splits_for(batch: int, head_blocks: int, max_seq_len: int, cfg: dict, device: torch.device) -> int:
    """Key-range splits so that about ``target_waves`` programs per SM run, each with enough keys."""
    programs = batch * head_blocks
    target = _sm_count(device) * cfg["target_waves"]
    if programs >= target:
        return 1
    by_work = max(1, cdiv(max_seq_len, cfg["split_min_tokens"]))
    return max(1, min(cdiv(target, programs), by_work, MAX_SPLITS))


@dataclass(slots=True)
class Partials:
    """``decode_partials``' result: ``out`` [B, H, Dl] (written only with one split), else per split
    ``part_out`` [B, H, S, Dl] / ``part_lse`` [B, H, S] float32, written for the splits holding keys
    (``live_splits`` of ``seq_lens`` with this launch's ``block_n`` and ``min_tiles``)."""

    out: torch.Tensor
    part_out: torch.Tensor
    part_lse: torch.Tensor
    splits: int
    block_n: int
    min_tiles: int


def decode_partials(q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, max_seq_len: int, config: dict | None = None,
                    num_splits: int | None = None) -> Partials:
    """The split launch of ``mla_decode`` (arguments as there); with one split the partial buffers are
    ``out`` itself (unused), with more ``out`` is left for a combining launch."""
    batch, heads, dl = q_lat.shape
    dr = q_pe.shape[2]
    if kv.shape[2] != dl + dr or kv.stride(2) != 1 or q_lat.stride(2) != 1 or q_pe.stride(2) != 1:
        raise ValueError(f"mla_decode: kv {tuple(kv.shape)} must be rows of latent {dl} + rope {dr}, unit stride")
    if block_tables.dtype != torch.int32:
        raise ValueError("mla_decode: block_tables must be int32")
    out = q_lat.new_empty(batch, heads, dl)
    cfg = dict(decode_config(heads, dl, dr, q_lat.device) if config is None else config)
    min_tiles = max(1, cdiv(cfg.get("split_live_min_tokens", 0), cfg["BLOCK_N"]))
    if batch == 0:
        return Partials(out, out, out, 1, cfg["BLOCK_N"], min_tiles)
    block_h = max(16, min(cfg["BLOCK_H"], next_power_of_2(heads)))  # tl.dot needs 16 rows
    head_blocks = cdiv(heads, block_h)
    splits = num_splits or num_splits_for(batch, head_blocks, max_seq_len, cfg, q_lat.device)
    part_out = part_lse = out  # unused without splits
    if splits > 1:
        part_out = torch.empty(batch, heads, splits, dl, device=q_lat.device, dtype=torch.float32)
        part_lse = torch.empty(batch, heads, splits, device=q_lat.device, dtype=torch.float32)
    precision = "ieee" if q_lat.dtype == torch.float32 else "tf32"
    _mla_decode_split_kernel[(batch, head_blocks, splits)](
        q_lat, q_pe, kv, block_tables, seq_lens, part_out, part_lse, out,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), kv.stride(0), kv.stride(1),
        block_tables.stride(0), out.stride(0), out.stride(1), heads, splits, min_tiles, scale * LOG2E,
        DL=dl, DR=dr, BLOCK_DL=next_power_of_2(dl), BLOCK_DR=max(16, next_power_of_2(dr)),
        BLOCK_H=block_h, BLOCK_N=cfg["BLOCK_N"], PAGE=kv.shape[1], SPLIT=splits > 1, DOT_PRECISION=precision,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return Partials(out, part_out, part_lse, splits, cfg["BLOCK_N"], min_tiles)


def mla_decode(q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, block_tables: torch.Tensor,
               seq_lens: torch.Tensor, scale: float, max_seq_len: int, config: dict | None = None,
               num_splits: int | None = None) -> torch.Tensor:
    """Absorbed paged MLA decode. q_lat [B, H, Dl], q_pe [B, H, Dr] (unit last stride), kv
    [NB, BS, Dl + Dr] (contiguous rows), block_tables [B, max_blocks] int32, seq_lens [B] int32;
    ``max_seq_len``: a host bound on seq_lens (a CUDA graph passes its bucket's limit). Returns
    the attention-weighted latents [B, H, Dl] in q_lat's dtype, as ``naive.mla_decode_ref``."""
    p = decode_partials(q_lat, q_pe, kv, block_tables, seq_lens, scale, max_seq_len, config, num_splits)
    batch, heads, dl = p.out.shape
    if p.splits > 1 and batch > 0:
        _mla_combine_kernel[(batch, heads)](
            p.part_out, p.part_lse, seq_lens, p.out, heads, p.splits, p.min_tiles, p.block_n, p.out.stride(0),
            p.out.stride(1), DL=dl, BLOCK_DL=next_power_of_2(dl),
            BLOCK_S=max(16, next_power_of_2(p.splits)), num_warps=4,
        )
    return p.out
