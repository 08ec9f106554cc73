"""FP8 KV cache layout: a model's cache layout rewritten for ``--kv-cache-dtype fp8``, high-precision layers kept, per-layer scales set.

``fp8_kv_layout(layout, "fp8", "auto")`` gives every full / sliding attention layer an e4m3 page
with per-layer ``k_scale`` / ``v_scale`` (``kv_dtype`` float8_e4m3fn, ``scaled``), except the
high-precision ones: ``auto`` = the first and last attention layer (Atlas's default), ``N`` = the
first ceil(N / 2) and last floor(N / 2), ``i,j`` = those layer indices (one alone: ``i,``). ``apply_kv_scales`` fills
the scales: the checkpoint's ``k_scale`` / ``v_scale`` (``model.checkpoint_kv_scales``), else 1.0.
A stored value is ``x / scale`` in e4m3 (saturated at ±448) and is read back as ``q · scale``.
"""
from __future__ import annotations

import dataclasses
import logging

import torch

from armillary.cache_spec import FullAttention, LayerCacheSpec

log = logging.getLogger("armillary")
FP8_KV_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}


def high_precision_layers(layout: list[LayerCacheSpec | None], setting: str) -> set[int]:
    """Layout indices of the attention layers whose KV stays in the model dtype."""
    attention = [i for i, s in enumerate(layout) if isinstance(s, FullAttention)]
    setting = str(setting).replace(" ", "")
    if setting == "auto":
        return {attention[0], attention[-1]} if attention else set()
    if "," not in setting:  # a count N (one layer index alone is written "i,")
        n = min(int(setting), len(attention))
        return set(attention[: (n + 1) // 2]) | set(attention[len(attention) - n // 2:])
    parts = [p for p in setting.split(",") if p]
    chosen = {int(p) for p in parts}
    wrong = sorted(chosen - set(attention))
    if wrong:
        raise ValueError(f"kv_high_precision_layers {setting!r}: layers {wrong} are not attention layers "
                         f"(attention layers: {attention})")
    return chosen


def fp8_kv_layout(layout: list[LayerCacheSpec | None], kv_cache_dtype: str,
                  high_precision: str = "auto") -> list[LayerCacheSpec | None]:
    """``layout`` with fp8 pages on every attention layer but the high-precision ones (``auto``: unchanged)."""
    if kv_cache_dtype == "auto":
        return list(layout)
    dtype = FP8_KV_DTYPES.get(kv_cache_dtype)
    if dtype is None:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: choose auto or {', '.join(FP8_KV_DTYPES)}")
    keep = high_precision_layers(layout, high_precision)
    return [dataclasses.replace(s, kv_dtype=dtype, scaled=True) if isinstance(s, FullAttention) and i not in keep
            else s for i, s in enumerate(layout)]


def apply_kv_scales(caches: list, model: torch.nn.Module, layout: list[LayerCacheSpec | None] | None = None,
                    calibration_tokens: int = 0, vocab_size: int = 0, block_size: int = 16,
                    dtype: torch.dtype = torch.bfloat16) -> str:
    """Fill the scaled (fp8) caches' ``k_scale`` / ``v_scale``; returns where they came from.

    1. the checkpoint's per-layer scales (``model.checkpoint_kv_scales``, by layout index);
    2. else, with ``calibration_tokens`` > 0, ``calibrate_kv_scales`` over that many tokens;
    3. else 1.0 (as allocated).
    """
    scaled = [i for i, c in enumerate(caches) if c is not None and getattr(c, "k_scale", None) is not None]
    if not scaled:
        return "none"
    found = getattr(model, "checkpoint_kv_scales", None) or {}
    if found:
        missing = [i for i in scaled if i not in found]
        if missing:
            raise ValueError(f"the checkpoint has k_scale / v_scale for layers {sorted(found)} but not for the fp8 "
                             f"KV layers {missing}")
        for i in scaled:
            caches[i].k_scale.fill_(found[i].get("k", 1.0))
            caches[i].v_scale.fill_(found[i].get("v", 1.0))
        return "checkpoint"
    if calibration_tokens > 0:
        if layout is None or vocab_size < 1:
            raise ValueError("fp8 KV calibration needs the cache layout and the vocabulary size")
        calibrated = calibrate_kv_scales(model, layout, calibration_tokens, vocab_size, block_size, dtype)
        for i, (k, v) in calibrated.items():
            if i in scaled:
                caches[i].k_scale.fill_(k)
                caches[i].v_scale.fill_(v)
        return "calibrated"
    log.info("fp8 KV cache: no k_scale / v_scale in the checkpoint and no calibration; scales are 1.0")
    return "unit"


@torch.no_grad()
def calibrate_kv_scales(model: torch.nn.Module, layout: list[LayerCacheSpec | None], num_tokens: int,
                        vocab_size: int, block_size: int, dtype: torch.dtype,
                        seed: int = 0) -> dict[int, tuple[float, float]]:
    """Per fp8 layer ``(amax(K) / 448, amax(V) / 448)`` over one prefill of ``num_tokens`` seeded
    random tokens into throw-away model-dtype caches (as the worker's profile run builds them)."""
    from armillary.memory.planner import allocate_caches, plan_memory
    from armillary.model_runner import ModelRunner
    from armillary.sampling_params import SamplingParams
    from armillary.sequence import Sequence
    from armillary.step_plan import ScheduledChunk, StepPlan

    device = next(model.parameters()).device
    plain = [dataclasses.replace(s, kv_dtype=None, scaled=False) if isinstance(s, FullAttention) else s
             for s in layout]
    blocks = -(-num_tokens // block_size) + 1  # + the scratch block 0
    tmp = plan_memory(plain, budget_bytes=0, block_size=block_size, num_slots=2, dtype=dtype,
                      max_model_len=num_tokens, max_num_seqs=1, max_chunk=num_tokens, num_blocks_override=blocks)
    caches, states = allocate_caches(plain, tmp, dtype, device)
    runner = ModelRunner(model, caches, block_size, device, states=states, num_groups=max(1, len(tmp.paged_groups)))
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (num_tokens,), generator=gen).tolist()
    seq = Sequence("fp8-kv-calibration", 0, tokens, SamplingParams(max_tokens=1, temperature=0.0))
    seq.block_tables = [list(range(1, blocks)) for _ in tmp.paged_groups]
    seq.state_slot = 0
    step = runner.launch(StepPlan([ScheduledChunk(seq, 0, num_tokens, sample=True)], zero_slots=[0]))
    if hasattr(step, "wait"):
        step.wait()
    out = {}
    for i, spec in enumerate(layout):
        if isinstance(spec, FullAttention) and spec.scaled:
            k = caches[i].k[1:].float().abs().amax().item()  # block 0 is scratch
            v = caches[i].v[1:].float().abs().amax().item()
            out[i] = (max(k / 448.0, 1e-8), max(v / 448.0, 1e-8))
    log.info("fp8 KV cache: scales calibrated over %d tokens for %d layers", num_tokens, len(out))
    return out
