"""Attention over the paged KV cache in Triton: decode (split-KV) and varlen causal prefill.

One kernel serves both. A program owns one sequence, one kv head and a tile of ``BLOCK_Q`` query
tokens; the tile's rows are (token, q head of that kv head) pairs, so K/V is read once per kv head
for all of its GQA q heads. Keys are gathered through the block table (``k_cache: [num_blocks,
block_size, Hkv, D]``). When there are too few programs to fill the GPU (decode, short chunks over
long contexts) each program's key range is cut into ``num_splits`` pieces whose partial results
(output and log-sum-exp) a second kernel combines, as in flash-decoding. Split ranges are computed
on the device from ``seq_lens``, so the grid depends only on host ints: CUDA-graph capturable.
The reference is ``armillary.kernels.attention.paged_attention``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from armillary.kernels.triton.fp8_skinny import e4m3_to_bf16
from armillary.kernels.triton.gate import sigmoid_gated
from armillary.kernels.triton.host import cdiv, next_power_of_2
from armillary.kernels.triton.pdl import launch_options, pdl_prologue
from armillary.kernels.tuning import kernel_config

LOG2E = 1.4426950408889634
MAX_SPLITS = 64

# Launch defaults per padded head dim; tuning/sm_*.json overrides them ("paged_attention_decode" /
# "paged_attention_prefill", shape key "d{BLOCK_D}").
DECODE_DEFAULTS = {
    "d64": {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "split_min_tokens": 256, "target_waves": 2},
    "d128": {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "split_min_tokens": 256, "target_waves": 2},
    "d256": {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "split_min_tokens": 256, "target_waves": 2},
    "d512": {"BLOCK_N": 32, "num_warps": 8, "num_stages": 2, "split_min_tokens": 256, "target_waves": 2},
}
_PREFILL_SPLITS = {"split_min_tokens": 1024, "target_waves": 1}
PREFILL_DEFAULTS = {
    "d64": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2, **_PREFILL_SPLITS},
    "d128": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2, **_PREFILL_SPLITS},
    "d256": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2, **_PREFILL_SPLITS},
    "d512": {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 8, "num_stages": 1, **_PREFILL_SPLITS},
}


@triton.jit
def _attend_range(
    acc, l_i, m_i, q, lo, hi, kv_end, pos, window,
    bt_row_ptr, k_head_ptr, v_head_ptr,
    stride_kb, stride_ks, stride_vb, stride_vs,
    scale_log2, softcap_log2, softcap_inv2,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    MASKED: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FAST_FP8: tl.constexpr,
):
    """Online-softmax update of (acc, l_i, m_i) with keys ``lo..hi`` (``lo`` tile aligned).

    MASKED applies causal / window / ``kv_end`` masks; unmasked ranges are fully visible to every row.
    Logits live in the log2 domain (scaled by log2 e) so the exponentials are exp2. FAST_FP8: e4m3 pages
    widened to bf16 by integer moves (``e4m3_to_bf16``; exact, as Triton's cast, which takes the slower
    conversion unit twice a value and bound a 64-stream fp8 decode at ~1.3 TB/s).
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for start in range(lo, hi, BLOCK_N):
        kpos = start + offs_n  # [BLOCK_N] absolute key positions
        if MASKED:
            kv_ok = kpos < kv_end
            blk = tl.load(bt_row_ptr + kpos // PAGE, mask=kv_ok, other=0).to(tl.int64)
        else:
            blk = tl.load(bt_row_ptr + kpos // PAGE).to(tl.int64)
        slot = kpos % PAGE
        k_ptrs = k_head_ptr + (blk * stride_kb + slot * stride_ks)[None, :] + offs_d[:, None]  # [BLOCK_D, BLOCK_N]
        v_ptrs = v_head_ptr + (blk * stride_vb + slot * stride_vs)[:, None] + offs_dv[None, :]  # [BLOCK_N, BLOCK_DV]
        if MASKED:
            k = tl.load(k_ptrs, mask=kv_ok[None, :] & (offs_d[:, None] < HEAD_DIM), other=0.0)
            v = tl.load(v_ptrs, mask=kv_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
        else:
            if BLOCK_D == HEAD_DIM:
                k = tl.load(k_ptrs)
            else:
                k = tl.load(k_ptrs, mask=offs_d[:, None] < HEAD_DIM, other=0.0)
            if BLOCK_DV == HEAD_DIM_V:
                v = tl.load(v_ptrs)
            else:
                v = tl.load(v_ptrs, mask=offs_dv[None, :] < HEAD_DIM_V, other=0.0)
        if FAST_FP8:  # an fp8 cache widens exactly; its scale is folded into the logit scale
            k = e4m3_to_bf16(k)
            v = e4m3_to_bf16(v)
        else:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        s = tl.dot(q, k, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N] raw q·k
        if USE_SOFTCAP:
            # cap · tanh(x / cap) with tanh(y) = 2·sigmoid(2y) − 1, all times log2 e
            s = softcap_log2 * (2.0 * tl.sigmoid(s * softcap_inv2) - 1.0)
        else:
            s = s * scale_log2
        if MASKED:
            visible = (kpos[None, :] <= pos[:, None]) & kv_ok[None, :]
            if USE_WINDOW:
                visible = visible & (kpos[None, :] > pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if MASKED:
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked rows stay at zero weight
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    out_ptr, part_out_ptr, part_lse_ptr, gate_ptr, k_scale_ptr, v_scale_ptr,
    scale_log2, softcap_log2, softcap_inv2, window, num_splits,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt, stride_ot, stride_oh, stride_gt, stride_gh,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    SPLIT_KV: tl.constexpr, DECODE: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_GATE: tl.constexpr,
    PDL: tl.constexpr, KV_SCALED: tl.constexpr, FAST_FP8: tl.constexpr,
):
    """Grid (q tiles, B, Hkv · num_splits); q tiles run last-first so the longest causal rows start first.

    num_splits is a runtime int (no recompile per split count); SPLIT_KV says whether it exceeds 1.
    """
    pdl_prologue(PDL)
    if KV_SCALED:  # fp8 pages hold k / k_scale and v / v_scale
        scale_log2 = scale_log2 * tl.load(k_scale_ptr)
        softcap_inv2 = softcap_inv2 * tl.load(k_scale_ptr)
    q_tile = tl.num_programs(0) - 1 - tl.program_id(0)
    b = tl.program_id(1)
    kvh = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits
    if DECODE:
        q_start = b
        q_len = 1
    else:
        q_start = tl.load(query_start_loc_ptr + b)
        q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
    q0 = q_tile * BLOCK_Q
    if q0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    ctx = seq_len - q_len  # tokens cached before this step's queries

    rows = tl.arange(0, BLOCK_M)
    tok = q0 + rows // GROUP  # [BLOCK_M] query index within the sequence
    head = kvh * GROUP + rows % GROUP  # [BLOCK_M] q head
    row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    pos = ctx + tok  # [BLOCK_M] absolute position of each row's query
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_ptrs = q_ptr + (q_start + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)  # [BLOCK_M, BLOCK_D]

    # Keys seen by some row: [kv_lo, kv_hi); keys seen by every row: [full_lo, full_hi) (tile aligned).
    pos_first = ctx + q0
    pos_last = ctx + tl.minimum(q0 + BLOCK_Q, q_len) - 1
    kv_hi = pos_last + 1
    if USE_WINDOW:
        kv_lo = tl.maximum(pos_first - window + 1, 0)
        full_lo = tl.cdiv(tl.maximum(pos_last - window + 1, 0), BLOCK_N) * BLOCK_N
    else:
        kv_lo = 0
        full_lo = 0
    full_hi = ((pos_first + 1) // BLOCK_N) * BLOCK_N
    tile_lo = (kv_lo // BLOCK_N) * BLOCK_N
    tiles_per_split = tl.cdiv(tl.cdiv(kv_hi - tile_lo, BLOCK_N), num_splits)
    s_lo = tl.minimum(tile_lo + split * tiles_per_split * BLOCK_N, kv_hi)
    s_hi = tl.minimum(s_lo + tiles_per_split * BLOCK_N, kv_hi)
    head_end = tl.minimum(tl.maximum(full_lo, s_lo), s_hi)
    body_end = tl.maximum(tl.minimum(full_hi, s_hi), head_end)

    bt_row_ptr = block_tables_ptr + b.to(tl.int64) * stride_bt
    k_head_ptr = k_cache_ptr + kvh * stride_kh
    v_head_ptr = v_cache_ptr + kvh * stride_vh
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    acc, l_i, m_i = _attend_range(
        acc, l_i, m_i, q, s_lo, head_end, kv_hi, pos, window, bt_row_ptr, k_head_ptr, v_head_ptr,
        stride_kb, stride_ks, stride_vb, stride_vs, scale_log2, softcap_log2, softcap_inv2,
        HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, PAGE, True, USE_WINDOW, USE_SOFTCAP, DOT_PRECISION,
        FAST_FP8,
    )
    acc, l_i, m_i = _attend_range(
        acc, l_i, m_i, q, head_end, body_end, kv_hi, pos, window, bt_row_ptr, k_head_ptr, v_head_ptr,
        stride_kb, stride_ks, stride_vb, stride_vs, scale_log2, softcap_log2, softcap_inv2,
        HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, PAGE, False, USE_WINDOW, USE_SOFTCAP, DOT_PRECISION,
        FAST_FP8,
    )
    acc, l_i, m_i = _attend_range(
        acc, l_i, m_i, q, body_end, s_hi, kv_hi, pos, window, bt_row_ptr, k_head_ptr, v_head_ptr,
        stride_kb, stride_ks, stride_vb, stride_vs, scale_log2, softcap_log2, softcap_inv2,
        HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, PAGE, True, USE_WINDOW, USE_SOFTCAP, DOT_PRECISION,
        FAST_FP8,
    )

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # empty ranges (padded sequences, empty splits) give zeros
    out = acc / l_safe[:, None]
    if KV_SCALED:
        out = out * tl.load(v_scale_ptr)
    t_glob = (q_start + tok).to(tl.int64)
    dv_ok = offs_dv[None, :] < HEAD_DIM_V
    if not SPLIT_KV:
        out = out.to(out_ptr.dtype.element_ty)
        if HAS_GATE:
            g_ptrs = gate_ptr + t_glob[:, None] * stride_gt + head[:, None] * stride_gh + offs_dv[None, :]
            out = sigmoid_gated(out, g_ptrs, row_ok[:, None] & dv_ok)
        o_ptrs = out_ptr + t_glob[:, None] * stride_ot + head[:, None] * stride_oh + offs_dv[None, :]
        tl.store(o_ptrs, out, mask=row_ok[:, None] & dv_ok)
    else:
        part_row = (t_glob * NUM_HEADS + head) * num_splits + split  # [BLOCK_M] row of [T, Hq, S]
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(part_lse_ptr + part_row, lse, mask=row_ok)
        p_ptrs = part_out_ptr + part_row[:, None] * HEAD_DIM_V + offs_dv[None, :]
        tl.store(p_ptrs, out, mask=row_ok[:, None] & dv_ok)


@triton.jit
def _combine_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, gate_ptr, num_splits, stride_ot, stride_oh, stride_gt, stride_gh,
    NUM_HEADS: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_GATE: tl.constexpr, PDL: tl.constexpr,
):
    """Grid (T, Hq, cdiv(Dv, BLOCK_DV)): out = Σ_s 2^(lse_s − M) · out_s / Σ_s 2^(lse_s − M) over the splits
    (· sigmoid(gate)); each program combines BLOCK_DV columns, so the [BLOCK_S, BLOCK_DV] tile stays in registers."""
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    base = (t * NUM_HEADS + h) * num_splits
    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = tl.program_id(2) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    s_ok = offs_s < num_splits
    lse = tl.load(part_lse_ptr + base + offs_s, mask=s_ok, other=float("-inf"))  # [BLOCK_S]
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # [BLOCK_S]
    denom = tl.sum(w, 0)
    denom = tl.where(denom == 0.0, 1.0, denom)
    dv_ok = offs_dv < HEAD_DIM_V
    parts = tl.load(
        part_out_ptr + (base + offs_s)[:, None] * HEAD_DIM_V + offs_dv[None, :],
        mask=s_ok[:, None] & dv_ok[None, :], other=0.0,
    )  # [BLOCK_S, BLOCK_DV]
    out = (tl.sum(parts * w[:, None], 0) / denom).to(out_ptr.dtype.element_ty)
    if HAS_GATE:
        out = sigmoid_gated(out, gate_ptr + t * stride_gt + h * stride_gh + offs_dv, dv_ok)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_dv, out, mask=dv_ok)


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    """Multiprocessors of ``device``; a small stand-in on CPU (the Triton interpreter)."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def _num_splits(programs: int, max_kv_len: int, cfg: dict, device: torch.device) -> int:
    """Key-range splits so that about ``target_waves`` programs per SM exist, each with enough keys."""
    target = _sm_count(device) * cfg["target_waves"]
    if programs >= target:
        return 1
    by_work = max(1, cdiv(max_kv_len, cfg["split_min_tokens"]))
    return max(1, min(cdiv(target, programs), by_work, MAX_SPLITS))


def _check_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.dim() != 4:
        raise ValueError("paged attention: q must be [T, Hq, D], caches [num_blocks, block_size, Hkv, D]")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged attention: the head dim of q and the caches must be contiguous")
    hq, hkv = q.shape[1], k_cache.shape[2]
    if hq % hkv or k_cache.shape[3] != q.shape[2] or v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(f"paged attention: q {tuple(q.shape)} does not match caches {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)}")
    if block_tables.dtype != torch.int32:
        raise ValueError("paged attention: block_tables must be int32")


def _fast_fp8(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """e4m3 caches read by bf16 queries on a GPU take the integer widening (inline PTX: not in the interpreter)."""
    fp8 = torch.float8_e4m3fn
    return q.is_cuda and q.dtype == torch.bfloat16 and k_cache.dtype == fp8 and v_cache.dtype == fp8


def _launch(
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window, softcap,
    max_query_len: int, max_seq_len: int | None, out: torch.Tensor | None, cfg: dict, block_m: int,
    block_q: int, decode: bool, gate: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    _check_inputs(q, k_cache, v_cache, block_tables)
    T, Hq, D = q.shape
    page, Hkv, Dv = k_cache.shape[1], k_cache.shape[2], v_cache.shape[3]
    B = block_tables.shape[0]
    if gate is not None and (gate.shape != (T, Hq, Dv) or gate.stride(-1) != 1):
        raise ValueError(f"paged attention: gate must be [T, Hq, Dv] = {(T, Hq, Dv)} with unit last stride, "
                         f"not {tuple(gate.shape)}")
    if out is None:
        out = q.new_empty(T, Hq, Dv)
    gate_arg = gate if gate is not None else out  # unused by the kernels without HAS_GATE
    if T == 0 or B == 0:
        return out
    max_kv = max_seq_len if max_seq_len is not None else block_tables.shape[1] * page
    if sliding_window:
        max_kv = min(max_kv, sliding_window + max_query_len - 1)
    q_tiles = cdiv(max_query_len, block_q)
    splits = _num_splits(q_tiles * B * Hkv, max_kv, cfg, q.device)
    if splits > 1:
        part_out = torch.empty(T, Hq, splits, Dv, device=q.device, dtype=torch.float32)
        part_lse = torch.empty(T, Hq, splits, device=q.device, dtype=torch.float32)
    else:
        part_out = part_lse = out  # unused by the kernel without SPLIT_KV
    use_softcap = bool(softcap)
    _paged_attention_kernel[(q_tiles, B, Hkv * splits)](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc if query_start_loc is not None else seq_lens,
        out, part_out, part_lse, gate_arg, k_scale if k_scale is not None else seq_lens,
        v_scale if v_scale is not None else seq_lens, scale * LOG2E, (softcap or 1.0) * LOG2E, 2.0 * scale / (softcap or 1.0), int(sliding_window or 0), splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
        gate_arg.stride(0), gate_arg.stride(1), NUM_HEADS=Hq, GROUP=Hq // Hkv, HEAD_DIM=D, HEAD_DIM_V=Dv,
        BLOCK_D=next_power_of_2(D), BLOCK_DV=next_power_of_2(Dv),
        BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=cfg["BLOCK_N"], PAGE=page, SPLIT_KV=splits > 1, DECODE=decode,
        USE_WINDOW=bool(sliding_window), USE_SOFTCAP=use_softcap,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", HAS_GATE=gate is not None,
        KV_SCALED=k_scale is not None, FAST_FP8=_fast_fp8(q, k_cache, v_cache), num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], **launch_options(q.device),
    )
    if splits > 1:
        block_s = max(16, next_power_of_2(splits))
        # columns a program: at most 8K fp32 partials in registers (D 512 x 64 splits spilled as one tile)
        block_dv = min(next_power_of_2(Dv), max(16, 8192 // block_s))
        _combine_splits_kernel[(T, Hq, cdiv(Dv, block_dv))](
            part_out, part_lse, out, gate_arg, splits, out.stride(0), out.stride(1), gate_arg.stride(0),
            gate_arg.stride(1), NUM_HEADS=Hq, HEAD_DIM_V=Dv, BLOCK_DV=block_dv,
            BLOCK_S=block_s, HAS_GATE=gate is not None, num_warps=4,
            **launch_options(q.device),
        )
    return out


def _shape_key(head_dim: int) -> str:
    return f"d{max(64, next_power_of_2(head_dim))}"


def fit_element_size(cfg: dict, element_size: int) -> dict:
    """The tables hold configs for 2-byte (bf16 / fp16) q and caches; wider elements get proportionally
    fewer query rows and keys per tile, so no operand tile outgrows its 2-byte size (fp32 d256 prefill
    at the bf16 tiles needs 295424 bytes of shared memory, over sm_90's 232448)."""
    if element_size <= 2:
        return cfg
    shrink = element_size // 2
    return {**cfg, **{k: max(16, cfg[k] // shrink) for k in ("BLOCK_M", "BLOCK_N") if k in cfg}}


def _config(kernel: str, defaults: dict[str, dict], q: torch.Tensor, k_cache: torch.Tensor,
            override: dict | None) -> dict:
    """The table's launch config for q's head dim, fitted to the element size, then ``override``."""
    key = _shape_key(q.shape[2])
    base = defaults.get(key, defaults["d512"])
    cfg = kernel_config("armillary.kernels", kernel, key, base, q.device)
    return {**fit_element_size(cfg, max(q.element_size(), k_cache.element_size())), **(override or {})}


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    config: dict | None = None,
    gate: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One new query token per sequence over its cached context (the token itself already written).

    q: [B, Hq, D]; k_cache: [num_blocks, block_size, Hkv, D]; v_cache: [num_blocks, block_size, Hkv, Dv];
    block_tables: [B, max_blocks] int32; seq_lens: [B] int32 on the device (cached + 1; 0 marks a
    padding row, whose output is zeros). ``max_seq_len``: host upper bound of ``seq_lens`` that only
    sets the number of key splits (default: the block-table capacity); any value gives correct
    results, so a CUDA graph captured with a bucket stays valid for every length. ``out``: optional
    [B, Hq, Dv] destination. ``config`` overrides the tuning-table launch config. ``gate``: optional
    [B, Hq, Dv] (unit last stride, e.g. a view of the projection); the output is then
    ``attn · sigmoid(gate)``, each rounded to the dtype as the torch ops do. ``k_scale`` /
    ``v_scale``: fp32 scalars of an fp8 cache (values stored divided by them). Returns [B, Hq, Dv].
    """
    group = q.shape[1] // k_cache.shape[2]
    cfg = _config("paged_attention_decode", DECODE_DEFAULTS, q, k_cache, config)
    block_m = max(16, next_power_of_2(group))
    return _launch(q, k_cache, v_cache, block_tables, seq_lens, None, scale, sliding_window, softcap,
                   1, max_seq_len, out, cfg, block_m, 1, True, gate, k_scale, v_scale)


def paged_attention_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    config: dict | None = None,
    gate: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of varlen new tokens over their sequences' cached K/V (new chunk already written).

    q: [T, Hq, D]; caches as in ``paged_attention_decode``; query_start_loc: [B+1] int32 and
    seq_lens: [B] int32 on the device; query ``i`` of sequence ``b`` sits at position
    ``seq_lens[b] - n_b + i``. ``max_query_len`` (host int, >= every n_b) sizes the grid; mixed
    batches of prefill chunks and single-token decodes are fine. ``max_seq_len`` as in decode (it
    matters only when few query tiles exist, e.g. short chunks over long contexts). ``gate``
    ([T, Hq, Dv]), ``k_scale`` / ``v_scale`` as in decode. Returns [T, Hq, Dv].
    """
    group = q.shape[1] // k_cache.shape[2]
    pcfg = _config("paged_attention_prefill", PREFILL_DEFAULTS, q, k_cache, config)
    if max_query_len * group < pcfg["BLOCK_M"]:
        # few queries per sequence: decode-shaped tiles, key splits where the grid is small
        cfg = _config("paged_attention_decode", DECODE_DEFAULTS, q, k_cache, config)
        block_m = max(16, next_power_of_2(max_query_len * group))
    else:
        cfg = pcfg
        block_m = pcfg["BLOCK_M"]
    block_m = max(block_m, next_power_of_2(group))
    block_q = block_m // group
    return _launch(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window, softcap,
                   max(1, max_query_len), max_seq_len, out, cfg, block_m, block_q, False, gate, k_scale, v_scale)
