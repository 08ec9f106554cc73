"""The plugin's sm_90 tables send batch-1..8 decode to the GEMV MoE kernels and the skinny GEMM.

Table level (real sizes): every ``ops.linear`` shape of the Gemma-4-26B-A4B and Gemma-3-27B bench
configs (read off the models built on the meta device, bench/decode_shapes.py) that the H200 sweep
measured has an entry (Gemma 3's shapes, not yet swept, have none: cuBLAS); the "auto" backend takes
the skinny GEMM at M = 1 for every Gemma 4 projection (the tied vocab heads, and
the router at M = 1 as Qwen's measured, stay on cuBLAS until measured), the GEMV MoE path covers
T = 1..8, and no entry names a shape neither model asks for. Model level (tiny Gemma 4 MoE,
interpreter): with the sm_90 tables read on the CPU, a greedy run equals transformers while its
decode steps' MoE calls go through ``moe_gemv`` and its decode projections through the skinny GEMM
(never more rows than the table's ``max_rows``); the GEMV path proves the engine installed the
plugin's table overlay (core's sm_90 table has no GEMV entry).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from armillary import LLM, SamplingParams
from armillary.kernels.triton import moe as tri_moe
from armillary.kernels.triton import skinny_gemm as tri_sg
from plugins.gemma.tests.gemma_hf import hf_greedy, prompts
from tests.fixtures.decode_tables import (  # sm90_tables: a fixture
    assert_decode_paths, assert_tables_compile_for_sm90, sm90_tables, spy_decode_paths,  # noqa: F401
)

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import decode_shapes  # noqa: E402

MODELS = ("gemma4", "gemma3")
NEW = 3


def test_real_shapes_have_entries(sm90_tables):
    asked = set()
    for model, head in (("gemma4", (262144, 2816)), ("gemma3", (262208, 5376))):
        picks = decode_shapes.table_decisions(model)
        assert picks["heads"] == {head}
        for (n, k, m), use in picks["linear"].items():  # the H200 sweep decided each (cuBLAS where it was faster)
            if model == "gemma3":  # not swept yet: cuBLAS, where its b1 decode measured fastest (66.9 tok/s)
                assert not use, (model, n, k, m)
                continue
            assert use or m > 1 or (n, k) == head, (model, n, k, m)  # batch 1's projections are ours
            asked.add(tri_sg.config_key(m, n, k))
        gemv = [t for t, use in picks["gemv"].items() if use]
        assert gemv == (list(range(1, len(gemv) + 1)) if model == "gemma4" else []) and len(gemv) >= (4 * (model == "gemma4"))
    assert picks["keys"] == asked  # the plugin's table: Gemma 4's shapes, nothing else
    (moe,) = decode_shapes.moe_shapes("gemma4")
    assert (moe.experts, moe.pairs, moe.inter, moe.activation, moe.gated) == (128, 8, 704, "gelu_pytorch_tanh",
                                                                               True)
    assert moe.activation in tri_moe._ACTIVATIONS


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter evaluates masked-off lanes
def test_decode_takes_gemv_and_skinny(tiny_gemma, gemma_registry, sm90_tables, monkeypatch):
    directory, hf_model = tiny_gemma("gemma4_moe")
    batch = prompts((9, 5))
    moe_calls, gemv_calls, skinny_calls = spy_decode_paths(monkeypatch)
    llm = LLM(str(directory), registry=gemma_registry, dtype="float32", device="cpu", max_model_len=64, block_size=4,
              cpu_kv_cache_space_gb=0.01, kernel_backend="triton", enforce_eager=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch],
                        SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [
        hf_greedy(hf_model, p, NEW).sequences[0, len(p):].tolist() for p in batch]
    assert_decode_paths(moe_calls, gemv_calls, skinny_calls)


def test_table_configs_compile_for_sm90_and_fit():
    assert_tables_compile_for_sm90(MODELS)
