"""Gemma 3 / Gemma 4 through the Triton kernels (the GPU fast path) equal transformers, and a decode-only
step (as a CUDA graph replays it: no host lists) runs without reading ``batch.*_cpu``.

Without CUDA the kernels run in Triton's interpreter (the root conftest sets TRITON_INTERPRET): the
windowed, soft-capped, block-strided (Gemma 4's packed pages) and KV-shared paths all go through the
kernels the GPU runs; generations are short because the interpreter is slow.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from armillary import LLM, SamplingParams
from armillary.kernels import ops
from plugins.gemma.tests.gemma_hf import hf_greedy, prompts

NEW = 3
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def triton_backend():
    yield
    ops.set_backend("auto")  # the engine set it from kernel_backend; later tests get the default back


def _llm(directory, registry, budget: int = 12, **engine_args) -> LLM:
    # a 12-token budget mixes chunked prefills (after cached context) with decodes, then decode-only steps
    return LLM(str(directory), registry=registry, dtype="float32", device=DEVICE, max_model_len=64, block_size=4,
               max_num_batched_tokens=budget, cpu_kv_cache_space_gb=0.01, kernel_backend="triton",
               enforce_eager=True, **engine_args)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter evaluates masked-off lanes too
@pytest.mark.parametrize("name", ["gemma3_softcap", "gemma4_dense", "gemma4_moe"])
def test_triton_kernels_match_transformers(name, tiny_gemma, gemma_registry, triton_backend):
    directory, hf_model = tiny_gemma(name)
    batch = prompts((17, 5))  # the first longer than the 12-token window
    outs = _llm(directory, gemma_registry).generate([{"prompt_token_ids": p} for p in batch],
                                                     SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [
        hf_greedy(hf_model, p, NEW).sequences[0, len(p):].tolist() for p in batch]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_decode_only_step_reads_no_host_lists(tiny_gemma, gemma_registry, triton_backend):
    """A decode-only batch with ``*_cpu = None`` gives the hidden states the reference kernels give."""
    directory, _ = tiny_gemma("gemma4_dense")
    # no async scheduling (on by default on CUDA): the prefill step would launch the next decode itself
    engine = _llm(directory, gemma_registry, budget=64, async_scheduling=False).engine
    for i, prompt in enumerate(prompts((9, 14, 3))):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    engine.step()  # the three prefills
    plan = engine.scheduler.schedule()
    assert len(plan.chunks) == 3 and all(c.is_decode for c in plan.chunks)
    batch = engine.runner.prepare(plan)
    assert batch.is_decode_only
    graph_like = dataclasses.replace(batch, query_start_loc_cpu=None, context_lens_cpu=None, seq_lens_cpu=None)
    with torch.inference_mode():
        fast = engine.model(graph_like)  # [3, H]; writes the step's K/V (the reference run rewrites the same)
        ops.set_backend("reference")
        ref = engine.model(batch)
    torch.testing.assert_close(fast, ref, rtol=1e-4, atol=1e-4)
