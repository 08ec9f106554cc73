"""The transformers side of each model benchmark's same-run comparison: random bf16 weights, decode tok/s per batch size and one long prefill.

Each driver's ``hf_bench`` builds its model's transformers config and hands it here with what
differs (the batch sizes it compares, the vocabulary the prompts draw from, whether generate gets an
explicit mask); the figures are named ``decode_b{batch}`` and ``prefill`` (tokens per second).
"""
from __future__ import annotations

import gc
import multiprocessing
import os
import time
from collections.abc import Callable
from typing import Any

import torch


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _child_allocator() -> None:
    # transformers' torch Mamba-2 scan frees and reallocates ~32 GiB blocks at 16K: fragments without this
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"


def transformers_in_child(bench: Callable[..., dict], *args: Any) -> dict | None:
    """``bench(*args)`` (a driver's module-level ``hf_bench``) in a spawned process, so all its memory is
    back before armillary starts; None (and a FAILED line) if it fails: armillary's figures still come."""
    try:
        with multiprocessing.get_context("spawn").Pool(1, initializer=_child_allocator) as pool:
            return pool.apply(bench, args)
    except Exception as e:  # noqa: BLE001 - the comparison is optional
        print(f"transformers comparison FAILED: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
              flush=True)
        return None


def without(cfg_dict: dict, *keys: str) -> dict:
    """The benchmark's config.json dict less the keys the transformers config class does not take."""
    return {k: v for k, v in cfg_dict.items() if k not in keys}


def transformers_baseline(model_cls: Any, config: Any, device: str, prompt_len: int, new: int, prefill_len: int,
                          batches: tuple[int, ...] = (1, 8), vocab_cap: int | None = None,
                          explicit_mask: bool = False, verbose: bool = False) -> dict:
    """``model_cls`` (a transformers ``*ForCausalLM``) on ``config`` with random bf16 weights on ``device``.

    ``decode_b{b}``: b x (new - 1) tokens over the time of a ``new``-token generate less a one-token one
    (its prefill), after a warm-up, for each b in ``batches``; ``prefill``: ``prefill_len`` tokens through
    one forward (``logits_to_keep=1``). Prompt ids are drawn from [10, min(vocab, vocab_cap)).
    ``explicit_mask``: generate gets an all-ones attention mask and ``pad_token_id=0``; ``verbose``:
    prints each figure as it is measured.
    """
    with torch.device(device):
        model = model_cls._from_config(config, dtype=torch.bfloat16).eval()
    res = {}
    vocab = config.vocab_size if vocab_cap is None else min(config.vocab_size, vocab_cap)
    for b in batches:
        ids = torch.randint(10, vocab, (b, prompt_len), device=device)
        kw = dict(attention_mask=torch.ones_like(ids), pad_token_id=0) if explicit_mask else {}
        with torch.no_grad():
            model.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False, **kw)  # warm-up
            _sync(device)
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False, **kw)
            _sync(device)
            t_prefill = time.perf_counter() - t
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, **kw)
            _sync(device)
            dt = time.perf_counter() - t - t_prefill
        res[f"decode_b{b}"] = b * (new - 1) / dt
        if verbose:
            print(f"transformers decode batch {b}: {res[f'decode_b{b}']:.1f} tok/s", flush=True)
    ids = torch.randint(10, vocab, (1, prefill_len), device=device)
    with torch.no_grad():
        model(ids[:, :256])
        _sync(device)
        t = time.perf_counter()
        model(ids, logits_to_keep=1)
        _sync(device)
        res["prefill"] = prefill_len / (time.perf_counter() - t)
    if verbose:
        print(f"transformers prefill {prefill_len}: {res['prefill']:.0f} tok/s", flush=True)
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return res
