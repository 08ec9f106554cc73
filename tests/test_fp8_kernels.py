"""FP8 reference quantizers (round trip) and the Triton fp8 GEMM / fused MoE / e4m3 cast against the dequantizing references, odd sizes."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from armillary.kernels import fp8 as ref
from armillary.kernels.triton import fp8_gemm, fp8_moe
from armillary.kernels.triton.fp8_cast import to_e4m3
from armillary.kernels.triton.fp8_skinny import e4m3_to_f32_folded

E4M3_MAX = 448.0


def naive_block_quant(w: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Written independently of the library: loop over blocks, amax / 448."""
    n, k = w.shape
    scale = torch.empty((n + bn - 1) // bn, (k + bk - 1) // bk)
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            blk = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].float()
            s = max(blk.abs().max().item() / E4M3_MAX, 1e-12)
            scale[i, j] = s
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (blk / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


@pytest.mark.parametrize("shape,block", [((37, 70), (16, 32)), ((130, 257), (128, 128)), ((5, 9), (1, 9))])
def test_quantizer_round_trip(shape, block):
    torch.manual_seed(0)
    w = torch.randn(shape) * 3
    q, s = ref.quantize_blocks(w, *block)
    q2, s2 = naive_block_quant(w, *block)
    assert torch.equal(s, s2) and torch.equal(q.view(torch.uint8), q2.view(torch.uint8))
    back = ref.dequantize(q, s, *block)
    rel = ((back - w).abs() / w.abs().clamp(min=1e-3)).max().item()
    assert rel <= 2 ** -4 + 1e-6  # e4m3: 3 mantissa bits, round to nearest
    assert torch.equal(ref.dequantize(*ref.quantize_blocks(back, *block), *block), back)  # a fixed point


def _ratio(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("m", [1, 3, 37, 70])
@pytest.mark.parametrize("n,k,block", [(45, 96, (16, 32)), (33, 50, (1, 50)), (64, 80, (32, 16))])
def test_fp8_linear_matches_reference(m, n, k, block):
    torch.manual_seed(1)
    x = torch.randn(m, k)
    wq, s = ref.quantize_blocks(torch.randn(n, k), *block)
    bias = torch.randn(n)
    out = fp8_gemm.fp8_linear(x, wq, s, *block, bias)
    if m <= fp8_gemm.DECODE_MAX_ROWS:  # skinny decode path: weight-only, activations unquantized
        want = ref.linear(x, wq, s, *block, bias)
        assert _ratio(out, want) < 1e-5
    else:
        want = ref.linear_w8a8(x, wq, s, *block, bias)  # the same e4m3 activations (fp8_cast rounds as torch)
        assert _ratio(out, want) < 1e-5
        assert 1e-3 < _ratio(out, ref.linear(x, wq, s, *block, bias)) < 8e-2  # activation quantization shows


@pytest.mark.parametrize("m,tiles", [(1, dict(NSUB=2, SUB_K=16, K_TILES=1)), (1, dict(NSUB=1, SUB_K=16, K_TILES=2)),
                                     (5, dict(BLOCK_M=16, NSUB=1, SUB_K=16, K_TILES=2)),
                                     (5, dict(BLOCK_M=16, NSUB=1, SUB_K=16, K_TILES=3, unroll=True)),
                                     (20, dict(BLOCK_M=32, NSUB=1, SUB_K=32, K_TILES=1)),
                                     (5, dict(BLOCK_M=16, BLOCK_N=16, NSUB=1, SUB_K=16, K_TILES=2, scale_w=True)),
                                     (5, dict(BLOCK_M=16, BLOCK_N=16, NSUB=1, SUB_K=16, K_TILES=3, unroll=True,
                                              scale_w=True))])
@pytest.mark.parametrize("n,k,block", [(45, 96, (16, 32)), (33, 50, (1, 50)), (40, 150, (8, 32))])
def test_fp8_skinny_split_k_and_tiles(m, tiles, n, k, block):
    """Forced split-K (the last-arriver sum, tickets reset), sub-tiles narrower than a scale block, and the
    multi-row tiles unrolled into straight-line code."""
    torch.manual_seed(4)
    x = torch.randn(m, k)
    wq, s = ref.quantize_blocks(torch.randn(n, k), *block)
    bias = torch.randn(n)
    width = tiles.get("NSUB", 1) * tiles["SUB_K"]
    cfg = dict(tiles, split_k=triton.cdiv(triton.cdiv(k, width), tiles["K_TILES"]))
    want = ref.linear(x, wq, s, *block, bias)
    for _ in range(2):  # a second call starts from the reset tickets
        out = fp8_gemm.fp8_linear(x, wq, s, *block, bias, config=cfg)
        assert _ratio(out, want) < 1e-5
    assert cfg["split_k"] > 1


@pytest.mark.parametrize("m,k,group", [(5, 300, 128), (3, 96, 32), (2, 50, 64)])
def test_activation_quantization_is_the_references(m, k, group):
    """The prefill pre-pass: e4m3 bytes and scales bit-equal to quantize_act_groups (IEEE divisions)."""
    torch.manual_seed(5)
    x = torch.randn(m, k) * torch.logspace(-3, 2, k)
    x[0, :7] = torch.tensor([0.0, -448.0, 1e-30, 3.0, -3.0, 224.0, 7.5])
    q, s = fp8_gemm.quantize_act(x, group)
    want_q, want_s = ref.quantize_act_groups(x, min(group, k))
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(s.t(), want_s)


@pytest.mark.parametrize("activation,gated", [("relu2", False), ("relu2", True), ("silu", True),
                                               ("gelu_pytorch_tanh", True)])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_fused_into_the_quantization(activation, gated, dtype):
    """The fp8 MoE's between-GEMMs pass: act(gate) · up quantized in one launch, as act_and_mul then quantize_act
    (relu² exact in fp32: bit-equal; the sigmoid forms within a few e4m3 steps); odd width, two groups and a part."""
    from armillary.kernels.activation import act_and_mul, get_activation
    from armillary.kernels.triton import moe_decode

    code = {"relu2": moe_decode.ACT_RELU2, "silu": moe_decode.ACT_SILU, "gelu_pytorch_tanh": moe_decode.ACT_GELU_TANH}
    g = torch.Generator().manual_seed(len(activation))
    x = (torch.randn(7, 2 * 300 if gated else 300, generator=g) * 3).to(dtype)
    q, s = fp8_gemm.quantize_act(x, 128, rows=9, activation=code[activation], gated=gated)
    h = act_and_mul(x, activation) if gated else get_activation(activation)(x)  # [7, 300]
    want_q, want_s = fp8_gemm.quantize_act(h.contiguous(), 128, rows=9)
    got = q.float() * s.t().repeat_interleave(128, 1)[:, :300]
    want = want_q.float() * want_s.t().repeat_interleave(128, 1)[:, :300]
    assert q.shape == (9, 300) and s.shape == (3, 9) and not got[7:].any()  # padding rows quantize zeros
    if dtype == torch.float32:  # relu² bit-equal; the sigmoid forms an ulp off in a scale at most
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and _ratio(got, want) < 1e-6
        assert activation != "relu2" or torch.equal(s, want_s)
    else:  # the interpreter's bf16 cast truncates where torch rounds: some values one e4m3 step apart
        assert _ratio(got, want) < 4e-2
    with pytest.raises(ValueError, match="gated input takes an activation"):
        fp8_gemm.quantize_act(x, 128, gated=True)


@pytest.mark.parametrize("lead,n,k,block", [((), 63, 160, (16, 32)), ((3,), 96, 60, (128, 128)),
                                            ((2,), 40, 48, (1, 1 << 30))])  # fmt: skip
def test_dequantize_blocks_is_the_reference(lead, n, k, block):
    """Odd sizes: blocks past N and K, a stack of experts, per-channel scales (bn 1, bk past K)."""
    g = torch.Generator().manual_seed(n)
    w = torch.randn(*lead, n, k, generator=g)
    q, scale = ref.quantize_blocks(w, *block)
    out = fp8_gemm.dequantize_blocks(q, scale, *block, torch.float32)
    assert torch.equal(out, ref.dequantize(q, scale, *block, torch.float32))
    out = fp8_gemm.dequantize_blocks(q, scale, *block, torch.bfloat16)  # the interpreter's bf16 cast truncates
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.dequantize(q, scale, *block, torch.bfloat16).float(), rtol=2**-7, atol=0)


def test_prefill_path_forced_at_few_rows():
    """``prefill: True`` takes the fp8 tensor-core GEMM at decode sizes (what a sweep compares)."""
    torch.manual_seed(7)
    x = torch.randn(6, 96)
    wq, s = ref.quantize_blocks(torch.randn(45, 96), 16, 32)
    out = fp8_gemm.fp8_linear(x, wq, s, 16, 32, config=dict(prefill=True))
    assert _ratio(out, ref.linear_w8a8(x, wq, s, 16, 32, None)) < 1e-5


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("block,dtype", [((16, 16), torch.float32), ((1, None), torch.float32),
                                         ((16, 16), torch.bfloat16)])
def test_fp8_fused_moe_matches_reference(grouped, block, dtype):
    torch.manual_seed(2)
    t, e, k, h, inter = 7, 5, 2, 48, 32
    x = torch.randn(t, h).to(dtype)
    bn, bk = block[0], block[1] or max(h, inter)
    w13, s13 = ref.quantize_blocks(torch.randn(e, 2 * inter, h) * 0.2, bn, bk)
    w2, s2 = ref.quantize_blocks(torch.randn(e, h, inter) * 0.2, bn, bk)
    weights, ids = torch.rand(t, k).softmax(-1), torch.randint(0, e, (t, k))
    out = fp8_moe.fp8_fused_moe(x, w13, s13, w2, s2, bn, bk, weights, ids, "silu", grouped=grouped)
    want = ref.fused_moe(x, w13, s13, w2, s2, bn, bk, weights, ids, "silu", quantize_input=grouped)
    assert out.dtype == dtype
    # bf16: Triton's interpreter truncates fp32 -> bf16 stores (the GPU rounds to nearest), which
    # alone costs ~1.2% here; bench/fp8_gpu_checks.py holds the GPU at real sizes
    assert _ratio(out, want) < (1e-5 if dtype == torch.float32 else 2.5e-2)


@triton.jit
def _cast_kernel(x_ptr, q_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    tl.store(q_ptr + offs, to_e4m3(tl.load(x_ptr + offs, mask=ok, other=0.0)), mask=ok)


def test_triton_e4m3_rounding_is_torchs():
    torch.manual_seed(3)
    x = torch.cat([torch.randn(700) * s for s in (1e-3, 1.0, 30.0, 1000.0)])
    x[:6] = torch.tensor([124.0, 120.0, 1.0625, 3 * 2 ** -10, 464.0, -500.0])  # ties, a subnormal tie, saturation
    x[6:9] = torch.tensor([-0.0, -1e-6, -2.0 ** -10])  # negatives that round to zero keep the sign: 0x80
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    _cast_kernel[(triton.cdiv(x.numel(), 512),)](x, q, x.numel(), BLOCK=512)
    want = x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(want[6:9], torch.full((3,), 0x80, dtype=torch.uint8))
    assert torch.equal(q.view(torch.uint8), want)


@pytest.mark.parametrize("activation,gated", [("relu2", False), ("gelu_pytorch_tanh", True), ("gelu", True)])
@pytest.mark.parametrize("grouped", [False, True])
def test_fp8_fused_moe_activations(activation, gated, grouped):
    """relu² (plain experts, Nemotron), gelu-tanh fused in the GEMV; plain gelu takes the unfused GEMV."""
    torch.manual_seed(6)
    t, e, k, h, inter = 5, 4, 3, 32, 48
    x = torch.randn(t, h)
    w13, s13 = ref.quantize_blocks(torch.randn(e, (2 if gated else 1) * inter, h) * 0.3, 16, 16)
    w2, s2 = ref.quantize_blocks(torch.randn(e, h, inter) * 0.3, 16, 16)
    weights, ids = torch.rand(t, k), torch.randint(0, e, (t, k))
    out = fp8_moe.fp8_fused_moe(x, w13, s13, w2, s2, 16, 16, weights, ids, activation, grouped=grouped)
    want = ref.fused_moe(x, w13, s13, w2, s2, 16, 16, weights, ids, activation, quantize_input=grouped)
    assert _ratio(out, want) < 1e-5


def _prmt(a: int, b: int, sel: int) -> int:
    """PTX prmt.b32 (default mode): byte i of the result is byte (sel >> 4i) & 7 of {b, a} (a bytes 0-3)."""
    pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    return sum(pool[(sel >> (4 * i)) & 7] << (8 * i) for i in range(4))


def test_e4m3_to_bf16_bit_moves_are_exact():
    """The integer steps of fp8_skinny.e4m3_to_bf16's PTX, replayed on every e4m3 byte (four per word as
    the asm takes them), equal torch's e4m3 -> bf16; the GPU check runs the asm itself."""
    codes = [c for c in range(256) if c & 0x7F != 0x7F]  # e4m3fn has no inf; 0x7f / 0xff are NaN
    got = []
    for i in range(0, len(codes), 4):
        word = sum(c << (8 * j) for j, c in enumerate(codes[i:i + 4]))
        for sel in (0x5140, 0x7362):
            a = _prmt(0, word, sel)
            b = ((a & 0x7FFF7FFF) >> 4) | (a & 0x80008000)  # lop3 0xc0, shr, lop3 0xf8
            lanes = torch.tensor([b & 0xFFFF, b >> 16], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
            got += (lanes * torch.tensor(2.0 ** 120, dtype=torch.bfloat16)).tolist()  # mul.rn.bf16x2
    want = torch.tensor(codes, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.bfloat16)
    assert torch.equal(torch.tensor(got[: len(codes)], dtype=torch.bfloat16).view(torch.int16), want.view(torch.int16))


def test_e4m3_to_bf16_scaled_rounds_once():
    """fp8_skinny.e4m3_to_bf16_scaled's PTX replayed: the integer steps, then one bf16 multiply by bf16(s · 2^120),
    equal (q · bf16(s)) rounded to bf16 for every e4m3 byte and scales of any size below 2^8."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    q = codes.view(torch.float8_e4m3fn)
    raw = (q.to(torch.bfloat16) * torch.tensor(2.0 ** -120, dtype=torch.bfloat16))  # the lanes before the multiply
    assert torch.equal((raw.float() * 2.0 ** 120).to(torch.bfloat16), q.to(torch.bfloat16))
    for scale in (3.0517578125e-05, 1.7e-4, 2.2e-3, 0.731, 1.0, 37.5, 200.0):
        folded = torch.tensor(scale * 2.0 ** 120, dtype=torch.float32).to(torch.bfloat16)
        got = raw * folded  # mul.rn.bf16x2: the exact product rounded once
        want = (q.float() * torch.tensor(scale).to(torch.bfloat16).float()).to(torch.bfloat16)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), scale


@pytest.mark.parametrize("unroll", [False, True])
def test_fp8_skinny_scales_on_the_widened_weights(unroll):
    """dot_scale_w with bf16 x: every weight is q · bf16(block scale) rounded to bf16 (what the PTX multiply gives);
    one-hot rows of x read single weights back bit-exactly, across split K and a part tile (the GPU check runs the
    PTX itself)."""
    torch.manual_seed(6)
    n, k, block = 45, 96, (16, 32)
    cols = torch.tensor([0, 17, 40, 63, 95])
    x = torch.zeros(len(cols), k, dtype=torch.bfloat16)
    x[torch.arange(len(cols)), cols] = 1.0
    wq, s = ref.quantize_blocks(torch.randn(n, k), *block)
    s_full = s.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]  # [N, K]
    rounded_scale = (wq.float() * s_full.bfloat16().float()).bfloat16()[:, cols].T
    exact = (wq.float() * s_full).bfloat16()[:, cols].T
    assert not torch.equal(rounded_scale, exact)  # the two roundings differ on these scales
    cfg = dict(BLOCK_M=16, BLOCK_N=16, NSUB=1, SUB_K=32, K_TILES=2, split_k=2, unroll=unroll)
    assert torch.equal(fp8_gemm.fp8_linear(x, wq, s, *block, config={**cfg, "scale_w": True}), rounded_scale)
    dense = torch.randn(7, k).bfloat16()
    out = fp8_gemm.fp8_linear(dense, wq, s, *block, config={**cfg, "scale_w": True})
    assert _ratio(out, ref.linear(dense.float(), wq, s, *block, None)) < 8e-3


def test_skinny_decode_config_reads_the_tuning_table(monkeypatch):
    """fp8_skinny's launch configs come from core's tables under skinny_gemm's keys (n{N}_k{K}_m{rows})."""
    from armillary.kernels.triton import fp8_skinny

    asked = []

    def table(rows, n, k, device=None):
        asked.append(fp8_skinny.config_key(rows, n, k))
        return {**fp8_skinny.DEFAULTS, "DOT_BLOCK_N": 64, "dot_num_stages": 6, "split_k": 2}

    monkeypatch.setattr(fp8_skinny, "lookup_config", table)
    cfg = fp8_skinny.decode_config(5, 9216, 2048, 128, 128, torch.device("cpu"))
    assert asked == ["n9216_k2048_m8"]
    assert (cfg["BLOCK_N"], cfg["BLOCK_M"], cfg["SUB_K"], cfg["NSUB"], cfg["split_k"]) == (64, 16, 128, 1, 2)
    assert cfg["K_TILES"] == 8 and cfg["num_stages"] == 1  # the interpreter pipelines nothing


@triton.jit
def _fold_kernel(q_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    ok = offs < n
    tl.store(out_ptr + offs, e4m3_to_f32_folded(tl.load(q_ptr + offs, mask=ok, other=0.0)), mask=ok)


def test_e4m3_to_f32_folded_is_exact():
    """The one-row GEMM's and MoE GEMV's integer widening: every e4m3 code (subnormals, -0) times 2^-120, bit for bit."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    out = torch.empty(codes.shape, dtype=torch.float32)
    _fold_kernel[(1,)](codes.view(torch.float8_e4m3fn), out, codes.numel(), BLOCK=256)
    want = codes.view(torch.float8_e4m3fn).float() * 2.0 ** -120
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("n,k,block,width,split", [(45, 128, (16, 32), 32, 1), (37, 200, (128, 128), 128, 2),
                                                   (33, 64, (1, 64), 16, 1)])
def test_fp8_skinny_preload_equals_the_tile_loop(monkeypatch, n, k, block, width, split):
    """``preload`` (one row: a program's K tiles loaded as one tile before the PDL wait) gives the tile loop's sums,
    across split K, a part tile past K and per-channel scales; a width that would not be a power of two stays off."""
    from armillary.kernels.triton import fp8_skinny

    torch.manual_seed(8)
    wq, s = ref.quantize_blocks(torch.randn(n, k), *block)
    x = torch.randn(1, k)
    base = {**fp8_skinny.DEFAULTS, "BLOCK_N": 8, "BLOCK_K": width, "split_k": split}
    monkeypatch.setattr(fp8_skinny, "lookup_config", lambda *a, **kw: dict(base))
    loop = fp8_skinny.fp8_skinny_gemm(x, wq, s, *block)
    base["preload"] = True
    cfg = fp8_skinny.decode_config(1, n, k, *block, torch.device("cpu"))
    assert cfg["preload"] and cfg["K_TILES"] == 1
    pre = fp8_skinny.fp8_skinny_gemm(x, wq, s, *block)
    assert _ratio(pre, loop) < 1e-6
    assert _ratio(pre, ref.linear(x, wq, s, *block, None)) < 1e-5
    with pytest.raises(ValueError, match="inconsistent"):  # a preload of several K tiles is refused, not run
        fp8_skinny.fp8_skinny_gemm(x, wq, s, *block, config={"preload": True, "K_TILES": 2, "NSUB": 1})
    base.update(BLOCK_K=32, split_k=1)
    odd = fp8_skinny.decode_config(1, 16, 96, 16, 32, torch.device("cpu"))  # three 32-wide tiles: not a power of two
    assert not odd["preload"] and odd["K_TILES"] == 3
