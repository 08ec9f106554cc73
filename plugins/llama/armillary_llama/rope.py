"""Rotary inverse frequencies for llama: plain, linear-scaled, Llama 3.1 (``llama3``), or GGUF frequency factors.

Reads transformers' current ``rope_parameters`` (``{"rope_type", "rope_theta", ...}``) and the older
``rope_theta`` + ``rope_scaling`` pair alike. ``freq_factors`` is this plugin's own type for GGUF
files, which store Llama 3.1 scaling as per-frequency divisors (``rope_freqs.weight``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from armillary.hf_config import HFConfig
from armillary.kernels.rotary import rotary_inv_freq

ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")


@dataclass(frozen=True, slots=True)
class RopeArgs:
    rope_type: str
    theta: float
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    freq_factors: tuple[float, ...] = ()


def _as_dict(value: object) -> dict:
    if value is None:
        return {}
    return value.to_dict() if isinstance(value, HFConfig) else dict(value)  # type: ignore[call-overload]


def rope_args(hf_config: HFConfig) -> RopeArgs:
    """The RoPE settings of a llama ``config.json``; raises ``ValueError`` for a type we do not serve."""
    params = _as_dict(getattr(hf_config, "rope_parameters", None)) or _as_dict(getattr(hf_config, "rope_scaling", None))
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"RoPE type {rope_type!r} is not served by armillary-llama; it serves {list(ROPE_TYPES)}")
    args = RopeArgs(rope_type, float(theta), float(params.get("factor", 1.0)))
    if rope_type == "llama3":
        args = RopeArgs(rope_type, float(theta), float(params["factor"]), float(params["low_freq_factor"]),
                        float(params["high_freq_factor"]), int(params["original_max_position_embeddings"]))
    elif rope_type == "freq_factors":
        args = RopeArgs(rope_type, float(theta), freq_factors=tuple(float(f) for f in params["freq_factors"]))
    return args


def _llama3_inv_freq(inv_freq: torch.Tensor, args: RopeArgs) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by ``factor``, short ones kept, a smooth blend between."""
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = args.original_max_position_embeddings / args.low_freq_factor
    high_freq_wavelen = args.original_max_position_embeddings / args.high_freq_factor
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / args.factor, inv_freq)
    smooth = (args.original_max_position_embeddings / wavelen - args.low_freq_factor) / (
        args.high_freq_factor - args.low_freq_factor)
    blended = (1 - smooth) * scaled / args.factor + smooth * scaled
    in_between = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_between, blended, scaled)


def llama_inv_freq(args: RopeArgs, head_dim: int) -> torch.Tensor:
    """``[head_dim // 2]`` float32 inverse frequencies on the current default device."""
    inv_freq = rotary_inv_freq(head_dim, args.theta, device=torch.get_default_device())
    if args.rope_type == "linear":
        return inv_freq / args.factor
    if args.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, args)
    if args.rope_type == "freq_factors":
        if len(args.freq_factors) != head_dim // 2:
            raise ValueError(f"rope freq_factors has {len(args.freq_factors)} values, expected {head_dim // 2}")
        return inv_freq / torch.tensor(args.freq_factors, dtype=torch.float32, device=inv_freq.device)
    return inv_freq
