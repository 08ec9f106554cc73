"""The whole model with every prefill chunk through the chunk-parallel SSD scan (and the router's and gated norm's Triton kernels) equals transformers.

The chunked scan serves batches of at least ``chunked_min_tokens`` tokens (256 by default, more than
the tiny prompts here), so the threshold is dropped to 0 and the kernel chunk to 16 tokens: prefill
chunks continuing from slot states, several kernel chunks each, mixed with decodes under a 40-token
budget, each scan launching the three chunk passes.
"""
from __future__ import annotations

import pytest

from armillary import LLM, SamplingParams
from armillary.kernels import ops
from armillary_nemotron.ops.mamba import ssd_chunked, ssd_scan
from plugins.nemotron.tests.hf_models import CASES, make_reference, nemotron_registry
from tests.fixtures.decode_tables import Spy

NEW = 6
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter evaluates masked-off lanes


@pytest.fixture
def triton_backend():
    yield
    ops.set_backend("auto")


def test_chunk_parallel_scan_matches_transformers(tmp_path, monkeypatch, triton_backend):
    ref = make_reference(CASES[0], tmp_path, new_tokens=NEW)
    monkeypatch.setitem(ssd_scan.SCAN_DEFAULTS, "chunked_min_tokens", 0)
    monkeypatch.setitem(ssd_scan.SCAN_DEFAULTS, "CHUNK", 16)  # up to 3 kernel chunks per 40-token prefill chunk
    passes = Spy(ssd_chunked._state_pass_kernel, None)
    serial = Spy(ssd_scan._ssd_scan_kernel, None)
    monkeypatch.setattr(ssd_chunked, "_state_pass_kernel", passes)
    monkeypatch.setattr(ssd_scan, "_ssd_scan_kernel", serial)
    llm = LLM(str(ref.model_dir), registry=nemotron_registry(), dtype="float32", device="cpu", max_model_len=256,
              max_num_batched_tokens=40, kernel_backend="triton", enforce_eager=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in ref.prompts],
                        SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == ref.tokens
    assert passes.calls and not serial.calls
