"""``LLM.shutdown`` frees the model even though start-up froze the collector (``gc.freeze``)."""
from __future__ import annotations

import gc
import weakref

import pytest

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
