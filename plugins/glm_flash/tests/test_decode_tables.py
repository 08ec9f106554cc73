"""The plugin's sm_90 tables send batch-1..8 decode to the GEMV MoE kernels and the skinny GEMM.

Table level (real sizes): every ``ops.linear`` shape of the GLM-4.7-Flash bench config (read off the
model built on the meta device, bench/decode_shapes.py) has an entry the "auto" backend takes at
M = 1..8, the GEMV MoE path covers T = 1..8, and no entry names a shape the model does not ask for.
Model level (tiny, interpreter): with the sm_90 tables read on the CPU, a greedy run equals
transformers while its decode steps' MoE calls go through ``moe_gemv`` and its decode projections
through the skinny GEMM (never more rows than the table's ``max_rows``).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from armillary import LLM, SamplingParams
from armillary.kernels.triton import skinny_gemm as tri_sg
from plugins.glm_flash.tests.harness import glm_registry
from plugins.glm_flash.tests.hf_models import CASES_BY_NAME, make_reference
from tests.fixtures.decode_tables import (  # sm90_tables: a fixture
    assert_decode_paths, assert_tables_compile_for_sm90, sm90_tables, spy_decode_paths,  # noqa: F401
)

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import decode_shapes  # noqa: E402

MODELS = ("glm",)
NEW = 4
SHAPES = {(1344, 2048), (5120, 768), (2048, 5120), (8960, 512), (20480, 2048), (2048, 10240)}


def test_real_shapes_have_entries(sm90_tables):
    picks = decode_shapes.table_decisions("glm")
    assert not picks["heads"]  # the head stays on F.linear (LMHead)
    assert {(n, k) for n, k, _ in picks["linear"]} == SHAPES
    # the H200 sweep decided each shape and row count (cuBLAS where it was faster); at batch 1 every one is ours
    assert all(use for (n, k, m), use in picks["linear"].items() if m == 1), picks["linear"]
    gemv = [t for t, use in picks["gemv"].items() if use]
    assert gemv == list(range(1, len(gemv) + 1)) and len(gemv) >= 4  # batch 1..4 at least, then the decode kernels
    assert picks["keys"] == {tri_sg.config_key(m, n, k) for n, k, m in picks["linear"]}
    (moe,) = decode_shapes.moe_shapes("glm")
    assert (moe.experts, moe.shared, moe.pairs, moe.activation, moe.gated) == (65, 1, 5, "silu", True)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter evaluates masked-off lanes
def test_decode_takes_gemv_and_skinny(tmp_path, sm90_tables, monkeypatch):
    ref = make_reference(CASES_BY_NAME["lora_interleaved"], tmp_path)  # a dense layer, then two MoE layers
    batch = ref.prompts[:2]  # 1 and 9 tokens: cheap prefills under the interpreter
    moe_calls, gemv_calls, skinny_calls = spy_decode_paths(monkeypatch)
    llm = LLM(str(ref.model_dir), registry=glm_registry(), dtype="float32", device="cpu", max_model_len=128,
              kernel_backend="triton", enforce_eager=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch],
                        SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [t[:NEW] for t in ref.tokens[:2]]
    assert_decode_paths(moe_calls, gemv_calls, skinny_calls)


def test_table_configs_compile_for_sm90_and_fit():
    assert_tables_compile_for_sm90(MODELS)
