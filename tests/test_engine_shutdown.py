"""``LLM.shutdown`` frees the model even though start-up froze the collector (``gc.freeze``)."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from armillary import LLM, SamplingParams
from tests.fixtures.tiny_models import save_tiny_model


def test_shutdown_frees_the_model(tmp_path):
    save_tiny_model(tmp_path)
    llm = LLM(str(tmp_path), load_format="dummy", dtype="float32", device="cpu", max_model_len=64)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3, temperature=0.0))
    model, engine = weakref.ref(llm.engine.model), weakref.ref(llm.engine)
    llm.shutdown()
    assert model() is None  # gone although the LLM object itself is still alive
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([{"prompt_token_ids": [5]}], SamplingParams(max_tokens=1))
    del llm
    gc.collect()
    assert engine() is None  # its reference cycles are collectable again: start-up had frozen them


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the allocator's peak statistics exist on CUDA only")
def test_second_engine_plans_the_same_cache(tmp_path):
    """The planner reads the allocator's peak minus what is held as the activation peak: after ``shutdown``
    the first engine's peak (its weights and caches) must not shrink the next engine's cache."""
    save_tiny_model(tmp_path)
    args = dict(load_format="dummy", dtype="bfloat16", device="cuda", max_model_len=256,
                gpu_memory_utilization=0.3)
    first = LLM(str(tmp_path), **args)
    blocks = first.engine.plan.num_blocks
    peak = torch.empty(int(0.3 * torch.cuda.mem_get_info()[1]), dtype=torch.uint8, device="cuda")  # a use of
    del peak  # the device as large as the whole budget, inside the first engine's life
    first.shutdown()
    del first
    gc.collect()
    second = LLM(str(tmp_path), **args)
    assert second.engine.plan.num_blocks >= 0.95 * blocks
    second.shutdown()
