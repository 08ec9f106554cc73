"""Static weights loaded before the PDL wait (``preload``): the skinny GEMVs compiled offline for sm_90 issue the
program's weight-tile loads between ``launch_dependents`` and ``wait``, and the activation loads after it."""
from __future__ import annotations

import importlib

import pytest

from armillary.testing.offline_ptx import PDL_MARKS, instruction_sequence, kernel_ptx

SKINNY_INTS = ("M", "N", "K", "stride_xm", "stride_wn", "stride_om", "blocks_per_split", "split_k")
FP8_INTS = ("M", "N", "K", "stride_xm", "stride_wn", "stride_om", "stride_sn", "stride_sk", "split_k")


def loads_around_wait(ptx: str) -> tuple[int, int]:
    """(global loads before the first ``griddepcontrol.wait``, after it); launch_dependents must come first."""
    marks = instruction_sequence(ptx, PDL_MARKS)
    wait = marks.index("griddepcontrol.wait")
    assert marks[0] == "griddepcontrol.launch_dependents", marks[:4]
    return marks[:wait].count("ld.global"), marks[wait:].count("ld.global")


@pytest.mark.parametrize("preload", [True, False])
def test_skinny_gemm_preload_loads_the_weight_tile_before_the_wait_on_sm90(preload):
    """One row, BLOCK_N 8 x BLOCK_K 2048 bf16 over 4 warps: 32 KB a program, 16 sixteen-byte loads a thread."""
    consts = {"HAS_BIAS": False, "USE_DOT": False, "DOT_PRECISION": "tf32", "EVEN_K": True, "BLOCK_M": 1,
              "BLOCK_N": 8, "BLOCK_K": 2048, "PDL": True, "PREFETCH": False, "PRELOAD": preload}
    ptrs = {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32",
            "ticket_ptr": "*i32"}
    signature = {**ptrs, **dict.fromkeys(SKINNY_INTS, "i32"), **dict.fromkeys(consts, "constexpr")}
    before, after = loads_around_wait(kernel_ptx("armillary.kernels.triton.skinny_gemm", "_skinny_gemm_kernel",
                                                 signature, consts))
    assert (before >= 16) if preload else (before == 0)
    assert after >= 1  # x, after the wait


@pytest.mark.parametrize("preload", [True, False])
def test_fp8_skinny_preload_loads_the_weight_tile_before_the_wait_on_sm90(preload):
    """One row of Qwen3.6's GDN in_proj (K 2048, 128 x 128 scale blocks) at BLOCK_N 16: with preload the merged
    tile (NSUB 8 x SUB_K 128 fp8) is loaded before the wait; without it the loop's loads all follow it."""
    consts = {"GROUP_N": 128, "GROUP_K": 128, "K_SCALED": True, "ROWS_SHARE": True, "HAS_BIAS": False,
              "USE_DOT": False, "DOT_PRECISION": "tf32", "EVEN_K": True, "K_TILES": 1 if preload else 8,
              "BLOCK_M": 1, "BLOCK_N": 16, "NSUB": 16 if preload else 2, "SUB_K": 128, "FAST_BF16": True,
              "UNROLL": False, "SCALE_W": False, "PDL": True, "PREFETCH": False, "PRELOAD": preload}
    ptrs = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*bf16",
            "part_ptr": "*fp32", "ticket_ptr": "*i32"}
    signature = {**ptrs, **dict.fromkeys(FP8_INTS, "i32"), **dict.fromkeys(consts, "constexpr")}
    before, after = loads_around_wait(kernel_ptx("armillary.kernels.triton.fp8_skinny", "_fp8_skinny_kernel",
                                                 signature, consts))
    assert (before >= 8) if preload else (before == 0)  # 16 rows x 2048 fp8 over 128 threads: 16-byte loads
    assert after >= 1


@pytest.mark.parametrize("preload", [True, False])
def test_fp4_skinny_preload_loads_words_and_scales_before_the_wait_on_sm90(preload):
    """One row of an NVFP4 in_proj (K 2048) at BLOCK_N 8: the int32 weight words and their e4m3 group scales."""
    consts = {"HAS_BIAS": False, "USE_DOT": False, "DOT_PRECISION": "tf32", "EVEN_K": True, "K_TILES": 1,
              "BLOCK_M": 1, "BLOCK_N": 8, "BLOCK_K": 2048, "PDL": True, "PREFETCH": False, "PRELOAD": preload}
    ptrs = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*fp8e4nv", "g_ptr": "*fp32", "bias_ptr": "*bf16",
            "out_ptr": "*bf16", "part_ptr": "*fp32", "ticket_ptr": "*i32"}
    ints = ("M", "N", "K", "stride_xm", "stride_wn", "stride_sn", "stride_om", "split_k")
    signature = {**ptrs, **dict.fromkeys(ints, "i32"), **dict.fromkeys(consts, "constexpr")}
    before, after = loads_around_wait(kernel_ptx("armillary.kernels.triton.fp4_gemv", "_fp4_skinny_kernel",
                                                 signature, consts))
    assert (before >= 2) if preload else (before == 0)  # words and scales
    assert after >= 1


def test_fp8_moe_down_pairs_loads_id_weight_and_tile_before_the_wait_on_sm90():
    """Qwen3.6's down GEMV over pairs (I 512, 128 x 128 blocks) at BLOCK_N 8: the pair's expert id, routing
    weight and [8, 512] fp8 tile before the wait; h after it."""
    consts = {"TOP_K": 9, "GROUP_N": 128, "GROUP_K": 128, "K_SCALED": True, "ROWS_SHARE": True, "EVEN_K": True,
              "BLOCK_N": 8, "NSUB": 4, "SUB_K": 128, "PDL": True}
    ptrs = {"h_ptr": "*fp32", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "out_ptr": "*bf16", "ids_ptr": "*i32",
            "topw_ptr": "*fp32", "part_ptr": "*fp32", "ticket_ptr": "*i32"}
    ints = ("T", "N", "K", "stride_hm", "stride_we", "stride_wn", "stride_se", "stride_sn", "stride_sk", "stride_om")
    signature = {**ptrs, **dict.fromkeys(ints, "i32"), **dict.fromkeys(consts, "constexpr")}
    before, after = loads_around_wait(kernel_ptx("armillary.kernels.triton.fp8_moe_down", "_gemv_down_pairs_kernel",
                                                 signature, consts))
    assert before >= 3  # id, weight, the tile's 16-byte loads
    assert after >= 1


@pytest.mark.parametrize("module,kernel,rows", [
    ("fp8_moe_down", "_gemv_down_pairs_kernel", "T"), ("fp8_skinny", "_fp8_skinny_kernel", "M"),
    ("skinny_gemm", "_skinny_gemm_kernel", "M"), ("fp4_gemv", "_fp4_skinny_kernel", "M")])
def test_split_k_kernels_keep_their_row_count_unspecialized(module, kernel, rows):
    """A launch at one row would make the row count a constexpr int, which split_k_epilogue cannot widen to int64
    (a compile error on the GPU at batch 1; the interpreter does not specialize, so only this catches it)."""
    fn = getattr(importlib.import_module(f"armillary.kernels.triton.{module}"), kernel)
    kept = fn.kwargs["do_not_specialize"] if hasattr(fn, "kwargs") else fn.do_not_specialize  # interpreter: as given
    names = {fn.arg_names[i] if isinstance(i, int) else i for i in kept or ()}
    assert rows in names


@pytest.mark.parametrize("late", [True, False])
def test_fp8_moe_up_late_trigger_waits_before_launching_dependents_on_sm90(late):
    """``late_trigger``: the up GEMV's programs wait first and only then let the down kernel launch."""
    consts = {"A_DIV": 9, "GROUP_N": 128, "GROUP_K": 128, "K_SCALED": True, "ROWS_SHARE": True, "GATED": True,
              "ACT": 0, "EVEN_K": True, "K_TILES": 1, "STAGES": 1, "BLOCK_N": 4, "NSUB": 16, "SUB_K": 128,
              "PDL": True, "PREFETCH_EXPERTS": False, "LATE_TRIGGER": late}
    ptrs = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "h_ptr": "*fp32", "ids_ptr": "*i32",
            "w2_ptr": "*fp8e4nv"}
    ints = ("I", "K", "stride_xm", "stride_we", "stride_wn", "stride_se", "stride_sn", "stride_sk", "stride_hm",
            "expert_stride_w13", "expert_stride_w2", "bytes_w13", "bytes_w2", "chunk_bytes")
    signature = {**ptrs, **dict.fromkeys(ints, "i32"), **dict.fromkeys(consts, "constexpr")}
    marks = instruction_sequence(kernel_ptx("armillary.kernels.triton.fp8_moe", "_gemv_up_kernel", signature,
                                            consts), PDL_MARKS)
    first = ["griddepcontrol.wait", "griddepcontrol.launch_dependents"]
    assert marks[:2] == (first if late else first[::-1]), marks[:4]
