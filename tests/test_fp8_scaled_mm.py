"""The cuBLAS block-scaled prefill route (fp8_scaled_mm) on CPU: its operand layouts against torch's rules and the dequantizing reference, the dispatch decision, the probe, the padded quantizer."""
from __future__ import annotations

import pytest
import torch

from armillary.kernels import fp8 as ref
from armillary.kernels.triton import fp8_gemm, fp8_scaled_mm


def _ratio(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def torch_accepts(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor) -> bool:
    """torch 2.11's (BlockWise1x128, BlockWise128x128) checks (ScaledBlas.cpp ``get_joint_scaling``):
    a row-major, b column-major, scale_a [M, K/128] strides (1, M), scale_b.t() [N/128, K/128] strides (K/128, 1)."""
    m, k = a.shape
    n = b.shape[1]
    kb = -(-k // 128)

    def size_stride(t, dim, size, stride):  # a dimension of size 1 has no meaningful stride
        return t.shape[dim] == size and (size <= 1 or t.stride(dim) == stride)

    sbt = sb.t()
    return (a.stride(1) == 1 and b.stride(0) == 1 and k % 16 == 0 and n % 16 == 0 and sa.dtype == sb.dtype == torch.float32
            and sa.dim() == 2 and size_stride(sa, 0, m, 1) and size_stride(sa, 1, kb, m)
            and sbt.dim() == 2 and size_stride(sbt, 0, -(-n // 128), kb) and size_stride(sbt, 1, kb, 1))


def fake_scaled_mm(a, b, scale_a, scale_b, bias=None, out_dtype=None, out=None, **_):
    """torch._scaled_mm as cuBLAS computes it, refusing what torch refuses; ``out`` written in place."""
    if not torch_accepts(a, b, scale_a, scale_b):
        raise RuntimeError("Invalid scaling configuration")
    result = fp8_scaled_mm.emulate(a, b, scale_a, scale_b, torch.float32)
    if bias is not None:
        assert bias.dtype == out_dtype
        result = result + bias.float()
    if out is None:
        return result.to(out_dtype)
    assert out.shape == result.shape and out.stride(1) == 1 and out.dtype == out_dtype
    return out.copy_(result)


def _weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    spread = torch.exp2(torch.randint(-6, 7, (n // 128, k // 128), generator=gen).float())  # scales differ per block
    return ref.quantize_blocks(torch.randn(n, k, generator=gen) * ref.expand_scale(spread, n, k, 128, 128), 128, 128)


def test_padded_quantizer_is_the_reference_plus_zero_rows():
    torch.manual_seed(0)
    x = torch.randn(37, 384) * torch.logspace(-2, 1, 384)
    q, s = fp8_gemm.quantize_act(x, 128, fp8_scaled_mm.padded_rows(37))
    want_q, want_s = ref.quantize_act_groups(x, 128)
    assert q.shape == (48, 384) and s.shape == (3, 48) and s.is_contiguous()
    assert torch.equal(q[:37].view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s[:, :37].t(), want_s)
    assert not q[37:].view(torch.uint8).any() and torch.all(s[:, 37:] == ref.MIN_SCALE)


@pytest.mark.parametrize("m,n,k", [(37, 256, 512), (5, 384, 1024)])
def test_operand_layout_is_torchs_and_the_reference(m, n, k):
    torch.manual_seed(1)
    x = torch.randn(m, k) * torch.exp2(torch.randint(-5, 6, (m, 1)).float())
    wq, ws = _weights(n, k, m)
    xq, xs = fp8_gemm.quantize_act(x, 128, fp8_scaled_mm.padded_rows(m))
    a, b, sa, sb = fp8_scaled_mm.operands(xq, xs, wq, ws)
    assert torch_accepts(a, b, sa, sb)
    assert not torch_accepts(a, b, xs, sb) and not torch_accepts(a, b, sa, ws)  # the untransposed scales are refused
    got = fp8_scaled_mm.emulate(a, b, sa, sb, torch.float32)[:m]
    assert _ratio(got, ref.linear_w8a8(x, wq, ws, 128, 128, None)) < 1e-6
    with pytest.raises(ValueError, match="activation scales"):
        fp8_scaled_mm.operands(xq, xs.t().contiguous(), wq, ws)


def test_shape_rules():
    x = torch.zeros(200, 512, dtype=torch.bfloat16)
    wq, ws = _weights(256, 512, 0)
    assert fp8_scaled_mm.fits(200, x, wq, ws, 128, 128)
    assert not fp8_scaled_mm.fits(fp8_scaled_mm.MIN_ROWS, x, wq, ws, 128, 128)  # decode-sized calls stay Triton
    assert not fp8_scaled_mm.fits(200, x.float(), wq, ws, 128, 128)  # fp32 activations
    assert not fp8_scaled_mm.fits(200, x, wq, ws, 64, 128)  # other blocks
    w3, s3 = _weights(256, 384, 0)  # K / 128 = 3 scales: cuBLAS wants them padded to 4, the op cannot
    assert not fp8_scaled_mm.fits(200, x[:, :384], w3, s3, 128, 128)
    assert not fp8_scaled_mm.fits(200, x, wq[:200], ws[:2], 128, 128)  # N not whole blocks below PARTIAL_MIN_ROWS
    big = torch.zeros(fp8_scaled_mm.PARTIAL_MIN_ROWS, 512, dtype=torch.bfloat16)
    assert fp8_scaled_mm.fits(big.shape[0], big, wq[:200], ws[:2], 128, 128)  # from there the last rows on Triton
    assert not fp8_scaled_mm.fits(big.shape[0], big, wq[:100], ws[:1], 128, 128)  # not one whole block


def test_cpu_never_takes_cublas_and_forcing_it_is_an_error():
    torch.manual_seed(2)
    x = torch.randn(150, 512, dtype=torch.bfloat16)
    wq, ws = _weights(256, 512, 3)
    assert not fp8_gemm.use_scaled_mm(150, x, wq, ws, 128, 128)
    with pytest.raises(ValueError, match="_scaled_mm"):
        fp8_gemm.fp8_linear(x, wq, ws, 128, 128, config=dict(scaled_mm=True))


def test_ready_route_goes_through_scaled_mm(monkeypatch):
    """With the device marked ready, a fitting prefill call is quantized (rows padded), multiplied by
    _scaled_mm with torch-valid operands and sliced back; the others stay on the Triton GEMM."""
    torch.manual_seed(4)
    calls = []

    def recorder(*args, **kwargs):
        calls.append(args[0].shape)
        return fake_scaled_mm(*args, **kwargs)

    monkeypatch.setitem(fp8_scaled_mm._READY, ("cpu", None), True)
    monkeypatch.setattr(torch, "_scaled_mm", recorder, raising=False)
    monkeypatch.setattr(fp8_scaled_mm, "MIN_ROWS", 16)  # small rows for the interpreter; prefill forced below 64
    x = torch.randn(37, 512).to(torch.float16)
    wq, ws = _weights(256, 512, 5)
    bias = torch.randn(256).to(torch.float16)
    out = fp8_gemm.fp8_linear(x, wq, ws, 128, 128, bias, config=dict(prefill=True))
    assert calls == [(48, 512)] and out.shape == (37, 256) and out.dtype == torch.float16
    want = ref.linear_w8a8(x, wq, ws, 128, 128, bias)
    assert _ratio(out, want) < 2e-3  # fp16 output rounding
    triton_out = fp8_gemm.fp8_linear(x, wq, ws, 128, 128, bias, config=dict(prefill=True, scaled_mm=False))
    assert _ratio(triton_out, want) < 2e-3
    fp8_gemm.fp8_linear(x[:16], wq, ws, 128, 128, bias, config=dict(prefill=True))  # not above MIN_ROWS
    fp8_gemm.fp8_linear(x[:5], wq, ws, 128, 128, bias)  # a decode call: the skinny GEMM
    assert len(calls) == 1


def test_probe_accepts_the_right_layout_and_rejects_a_wrong_one():
    cpu = torch.device("cpu")

    def right(xq, xs, w, s, bias, dtype, m):
        a, b, sa, sb = fp8_scaled_mm.operands(xq, xs, w, s)
        return fake_scaled_mm(a, b, sa, sb, bias=bias, out_dtype=dtype)[:m]

    def rows_swapped(xq, xs, w, s, bias, dtype, m):  # activation scales of the wrong rows
        return right(xq, xs.flip(1).contiguous(), w, s, bias, dtype, m)

    ok, why = fp8_scaled_mm.probe(cpu, fp8_gemm.quantize_act, right, m=20)
    assert ok, why
    ok, why = fp8_scaled_mm.probe(cpu, fp8_gemm.quantize_act, rows_swapped, m=20)
    assert not ok and "relative error" in why

    def refuses(*_):
        raise RuntimeError("DeepSeek style (1x128, 128x128) scaling only supported in CUDA for SM90")

    ok, why = fp8_scaled_mm.probe(cpu, fp8_gemm.quantize_act, refuses, m=20)
    assert not ok and "SM90" in why


@pytest.mark.parametrize("n,tail_rows", [(320, 0), (256, 24), (320, 24)])
def test_ready_route_splits_partial_blocks_and_writes_the_tail_in_place(monkeypatch, n, tail_rows):
    """N past the last whole 128-row block: cuBLAS takes the whole blocks (written into a column slice of the
    output), the Triton GEMM the last rows; unquantized tail rows land after them; all equal the reference."""
    torch.manual_seed(6)
    calls = []

    def recorder(*args, **kwargs):
        calls.append((args[1].shape[1], kwargs.get("out") is not None))
        return fake_scaled_mm(*args, **kwargs)

    monkeypatch.setitem(fp8_scaled_mm._READY, ("cpu", None), True)
    monkeypatch.setattr(torch, "_scaled_mm", recorder, raising=False)
    monkeypatch.setattr(fp8_scaled_mm, "MIN_ROWS", 16)
    monkeypatch.setattr(fp8_scaled_mm, "PARTIAL_MIN_ROWS", 32)
    x = torch.randn(37, 512).to(torch.float16)
    gen = torch.Generator().manual_seed(n)
    wq, ws = ref.quantize_blocks(torch.randn(n, 512, generator=gen), 128, 128)
    tail = torch.randn(tail_rows, 512, generator=gen).to(torch.float16) if tail_rows else None
    bias = torch.randn(n + tail_rows, generator=gen).to(torch.float16)
    out = fp8_gemm.fp8_linear(x, wq, ws, 128, 128, bias, config=dict(prefill=True), tail=tail)
    assert calls == [(n - n % 128, True)] and out.shape == (37, n + tail_rows)
    want = ref.linear_w8a8(x, wq, ws, 128, 128, bias[:n])
    if tail is not None:
        want = torch.cat([want, torch.nn.functional.linear(x.float(), tail.float(), bias[n:].float()).half()], 1)
    assert _ratio(out, want) < 2e-3
    assert _ratio(out[:, n - n % 128:], want[:, n - n % 128:]) < 2e-3  # the Triton rows and the tail on their own
    weight_only = ref.linear(x, wq, ws, 128, 128, bias[:n])  # the reference's tail contract: the same columns
    if tail is not None:
        weight_only = torch.cat([weight_only, torch.nn.functional.linear(x, tail, bias[n:])], 1)
    assert torch.equal(ref.linear(x, wq, ws, 128, 128, bias, tail), weight_only)


@pytest.mark.parametrize("rows", [5, 70])
def test_triton_paths_write_the_tail(rows):
    """Off cuBLAS (the skinny decode GEMM, the Triton prefill GEMM) the tail rows follow the fp8 ones."""
    torch.manual_seed(7)
    x = torch.randn(rows, 256)
    wq, ws = ref.quantize_blocks(torch.randn(96, 256), 32, 64)
    tail, bias = torch.randn(10, 256), torch.randn(106)
    out = fp8_gemm.fp8_linear(x, wq, ws, 32, 64, bias, tail=tail)
    fp8_ref = ref.linear if rows <= fp8_gemm.DECODE_MAX_ROWS else ref.linear_w8a8  # prefill quantizes x
    want = torch.cat([fp8_ref(x, wq, ws, 32, 64, bias[:96]), x @ tail.t() + bias[96:]], 1)
    assert out.shape == (rows, 106) and _ratio(out, want) < 1e-5
    assert _ratio(out[:, 96:], x @ tail.t() + bias[96:]) < 1e-5
