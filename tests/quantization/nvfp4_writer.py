"""The tests' own NVFP4 / FP8 quantizer and checkpoint writers: a bf16 checkpoint rewritten as ModelOpt or compressed-tensors publish it, beside its dequantized twin."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
GROUP = 16
FP8 = torch.float8_e4m3fn


def quantize(w: torch.Tensor, global_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor, float]:
    """w [N, K] -> (packed uint8 [N, K/2], e4m3 scales [N, K/16], global) as ModelOpt does it: global =
    amax / (6 · 448) multiplied in; each value the nearest e2m1 (ties to the even code) of w / (scale · global)."""
    w = w.float()
    n, k = w.shape
    g = global_scale if global_scale is not None else (w.abs().max() / (6 * 448)).item() or 1.0  # fp32 math
    groups = w.reshape(n, k // GROUP, GROUP)
    scale = (groups.abs().amax(-1) / 6 / g).clamp(max=448).to(FP8)  # [N, K/16]
    denom = scale.float()[..., None] * g
    v = torch.where(denom > 0, groups / torch.where(denom > 0, denom, 1.0), 0.0).clamp(-6, 6)
    dist = (v.abs()[..., None] - E2M1).abs()  # [N, K/16, 16, 8]
    nearest = dist == dist.min(-1, keepdim=True).values
    odd = torch.arange(8) % 2
    mag = (nearest.float() * (2 - odd)).argmax(-1)  # among equally near codes the even one
    codes = (mag + 8 * ((v < 0) & (mag > 0))).reshape(n, k).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)  # column 2j low nibble, 2j + 1 high
    return packed, scale, g


def dequantize(packed: torch.Tensor, scale: torch.Tensor, global_scale: float, divide: bool = False) -> torch.Tensor:
    """The weight an NVFP4 tensor stands for, fp32; ``divide``: the stored global scale divides (compressed-tensors)."""
    low, high = (packed & 0xF).long(), (packed >> 4).long()
    codes = torch.stack([low, high], -1).reshape(packed.shape[0], -1)
    values = E2M1[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    s = scale.float().repeat_interleave(GROUP, 1)
    return values * s / global_scale if divide else values * s * global_scale


def quantize_fp8_tensor(w: torch.Tensor) -> tuple[torch.Tensor, float]:
    """ModelOpt per-tensor FP8: (e4m3 weight, scale = amax / 448, multiplied in)."""
    s = max(w.abs().max().item() / 448, 1e-30)
    return (w.float() / s).clamp(-448, 448).to(FP8), s


def modelopt_nvfp4(tensors: dict[str, torch.Tensor], quantized: Callable[[str], bool]) -> tuple[dict, dict]:
    """(ModelOpt NVFP4 tensors, dequantized fp32 tensors) of a checkpoint; ``quantized(name)`` picks the weights."""
    out, deq = {}, {}
    for name, t in tensors.items():
        if not quantized(name):
            out[name] = deq[name] = t
            continue
        base = name.removesuffix("weight")
        packed, scale, g = quantize(t)
        out[name], out[base + "weight_scale"] = packed, scale
        out[base + "weight_scale_2"] = torch.tensor(g, dtype=torch.float32)  # a 0-d tensor, as ModelOpt writes it
        out[base + "input_scale"] = torch.tensor(0.01 + (hash(name) % 7) / 1000, dtype=torch.float32)
        deq[name] = dequantize(packed, scale, g)
    return out, deq


def compressed_tensors_nvfp4(tensors: dict[str, torch.Tensor], quantized: Callable[[str], bool]) -> tuple[dict, dict]:
    """(compressed-tensors nvfp4-pack-quantized tensors, dequantized fp32 tensors): the global scales
    stored as llm-compressor stores them, 448 · 6 / amax (the reciprocal of the factor)."""
    out, deq = {}, {}
    for name, t in tensors.items():
        if not quantized(name):
            out[name] = deq[name] = t
            continue
        base = name.removesuffix("weight")
        stored = torch.tensor(448 * 6 / max(t.abs().max().item(), 1e-30), dtype=torch.float32)
        packed, scale, _ = quantize(t, global_scale=(1 / stored).item())
        out[base + "weight_packed"], out[base + "weight_scale"] = packed, scale
        out[base + "weight_global_scale"] = stored.reshape(1)
        out[base + "input_global_scale"] = torch.tensor([448 * 6 / 3.0])
        deq[name] = dequantize(packed, scale, stored.item(), divide=True)
    return out, deq


def modelopt_fp8(name: str, t: torch.Tensor, out: dict, deq: dict) -> None:
    """One module's weight as ModelOpt per-tensor FP8 (weight, weight_scale, input_scale)."""
    base = name.removesuffix("weight")
    q, s = quantize_fp8_tensor(t)
    out[name], out[base + "weight_scale"] = q, torch.tensor(s, dtype=torch.float32)
    out[base + "input_scale"] = torch.tensor(0.02, dtype=torch.float32)
    deq[name] = q.float() * s


def write(model_dir: Path, tensors: dict[str, torch.Tensor], config: dict,
          extra: dict[str, dict] | None = None) -> Path:
    """A one-shard checkpoint: config.json, model.safetensors and any ``extra`` JSON files."""
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(config))
    for file, data in (extra or {}).items():
        (model_dir / file).write_text(json.dumps(data))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(model_dir / "model.safetensors"))
    return model_dir
