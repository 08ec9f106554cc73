"""The whole model through the Triton kernels (the GPU fast path: varlen conv, SSD scan, fused decode
step, group-limited router, relu² fused MoE, paged attention) equals transformers, and a
decode-only step as a CUDA graph replays it (no host lists) equals the reference kernels' step.

On a machine without CUDA the kernels run in Triton's interpreter (the root conftest sets TRITON_INTERPRET).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from armillary import LLM, SamplingParams
from armillary.forward_batch import RecurrentState
from armillary.kernels import ops
from plugins.nemotron.tests.hf_models import CASES, CASES_BY_NAME, make_reference, nemotron_registry

NEW = 6
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter evaluates masked-off lanes


@pytest.fixture
def triton_backend():
    yield
    ops.set_backend("auto")


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_triton_kernels_match_transformers(case, tmp_path, triton_backend):
    ref = make_reference(case, tmp_path, new_tokens=NEW)
    # a 40-token budget mixes chunked prefills with decodes, then runs decode-only steps
    llm = LLM(str(ref.model_dir), registry=nemotron_registry(), dtype="float32", device=DEVICE, max_model_len=256,
              max_num_batched_tokens=40, kernel_backend="triton", enforce_eager=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in ref.prompts],
                        SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == ref.tokens


def _states(model_caches) -> list[torch.Tensor]:
    return [t for c in model_caches if isinstance(c, RecurrentState) for t in c.tensors]


def test_decode_only_step_reads_no_host_lists(tmp_path, triton_backend):
    ref = make_reference(CASES_BY_NAME["M*-EM_groups4_router_groups"], tmp_path, new_tokens=1)
    # no async scheduling (on by default on CUDA): the prefill step would launch the next decode itself
    llm = LLM(str(ref.model_dir), registry=nemotron_registry(), dtype="float32", device=DEVICE, max_model_len=256,
              block_size=8, kernel_backend="triton", enforce_eager=True, async_scheduling=False)
    engine = llm.engine
    for i, prompt in enumerate(ref.prompts[:3]):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    engine.step()  # the prefills
    plan = engine.scheduler.schedule()
    assert len(plan.chunks) == 3 and all(c.is_decode for c in plan.chunks)
    batch = engine.runner.prepare(plan)
    assert batch.is_decode_only
    graph_like = dataclasses.replace(batch, query_start_loc_cpu=None, context_lens_cpu=None, seq_lens_cpu=None)
    states = _states(batch.caches)
    before = [s.clone() for s in states]
    with torch.inference_mode():
        fast = engine.model(graph_like)  # [3, H]
        after_fast = [s.clone() for s in states]
        for s, b in zip(states, before):
            s.copy_(b)  # the reference step starts from the same recurrent states
        ops.set_backend("reference")
        ref_hidden = engine.model(batch)
    torch.testing.assert_close(fast, ref_hidden, rtol=1e-4, atol=1e-4)
    for got, want in zip(after_fast, states):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
