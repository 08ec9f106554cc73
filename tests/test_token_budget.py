"""An unset ``max_num_batched_tokens`` is chosen by device: 16,384 on GPUs of 70 GiB or more, 8,192 on smaller, 2,048 on the CPU."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from armillary import LLM, SamplingParams
from armillary.config import EngineConfig, default_token_budget
from tests.fixtures.tiny_models import save_tiny_model


@pytest.mark.parametrize(("gib", "budget"), [(141, 16384), (80, 16384), (70, 16384), (48, 8192), (24, 8192)])
def test_gpu_budget_by_memory(monkeypatch, gib, budget):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=gib * 2**30))
    assert default_token_budget(torch.device("cuda", 0)) == budget


def test_cpu_budget_and_explicit_values_stay():
    assert default_token_budget(torch.device("cpu")) == 2048
    unset = EngineConfig(model="m")
    unset.validate()  # None is a valid setting: it means "by device"
    assert unset.resolve_token_budget(torch.device("cpu")) == 2048 == unset.max_num_batched_tokens
    explicit = EngineConfig(model="m", max_num_batched_tokens=96)
    assert explicit.resolve_token_budget(torch.device("cpu")) == 96
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(model="m", max_num_batched_tokens=0).validate()


def test_engine_resolves_before_planning(tmp_path):
    save_tiny_model(tmp_path)
    llm = LLM(str(tmp_path), load_format="dummy", dtype="float32", device="cpu", max_model_len=64)
    try:
        assert llm.engine.config.max_num_batched_tokens == 2048 == llm.engine.scheduler.max_num_batched_tokens
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3, temperature=0.0))
        assert len(out[0].outputs[0].token_ids) == 3
    finally:
        llm.shutdown()
