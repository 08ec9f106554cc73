"""The plugin's sm_90 tables send batch-1..8 decode to the GEMV MoE kernels, the skinny GEMM and the Mamba row split.

Table level (real sizes): every decode ``ops.linear`` shape of the Nano bench config (read off the
model built on the meta device, bench/decode_shapes.py) has an entry the "auto" backend takes at
M = 1..8, the GEMV MoE path covers T = 1..8, and no entry names a shape the model does not ask for.
Model level (tiny, interpreter): with the sm_90 tables read on the CPU, a greedy run equals
transformers while its decode steps' MoE calls go through ``moe_gemv``, its decode projections
through the skinny GEMM (never more rows than the table's ``max_rows``) and its Mamba layers
through the row-split kernel the table picks for that batch size.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from armillary import LLM, SamplingParams
from armillary.kernels import tuning
from armillary.kernels.triton import moe as tri_moe
from armillary.kernels.triton import skinny_gemm as tri_sg
from armillary_nemotron.ops.mamba import decode as tri_decode
from plugins.nemotron.tests.hf_models import CASES, make_reference, nemotron_registry
from tests.fixtures.decode_tables import (  # sm90_tables: a fixture
    Spy, assert_decode_paths, assert_tables_compile_for_sm90, sm90_tables, spy_decode_paths,  # noqa: F401
)

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import decode_shapes  # noqa: E402

MODELS = ("nemotron",)
NEW = 4


def test_real_shapes_have_entries(sm90_tables):
    picks = decode_shapes.table_decisions("nemotron")
    assert not picks["heads"]  # the head stays on F.linear (LMHead)
    assert {(n, k) for n, k, _ in picks["linear"]} == {(10304, 2688), (2688, 4096), (4608, 2688)}
    # the H200 sweep decided each shape and row count (cuBLAS where it was faster): batch 1's big ones are ours
    assert picks["linear"][(10304, 2688, 1)] and picks["linear"][(2688, 4096, 1)]
    gemv = [t for t, use in picks["gemv"].items() if use]
    assert gemv == list(range(1, len(gemv) + 1)) and len(gemv) >= 4  # batch 1..4 at least, then the decode kernels
    asked = {tri_sg.config_key(m, n, k) for n, k, m in picks["linear"]}
    assert picks["keys"] == asked  # no entry for a shape the model never asks for
    (moe,) = decode_shapes.moe_shapes("nemotron")
    assert (moe.activation, moe.gated) == ("relu2", False) and moe.activation in tri_moe._ACTIVATIONS


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter evaluates masked-off lanes
def test_decode_takes_gemv_skinny_and_row_split(tmp_path, sm90_tables, monkeypatch):
    case = CASES[0]  # ME*ME: 4 Mamba heads x 16, state 16, 2 groups; relu² experts with a stacked shared one
    ref = make_reference(case, tmp_path, new_tokens=NEW)
    batch = ref.prompts[:2]  # 1 and 9 tokens: cheap prefills under the interpreter
    # the row split for this tiny head shape, from the plugin's table as the Nano entry gives it
    real_load = tuning.load_table
    tiny_key = f"p{case.config['mamba_head_dim']}_n{case.config['ssm_state_size']}"

    def load_table(package, target):
        table = real_load(package, target)
        if package != "armillary_nemotron" or target != "sm_90":
            return table
        extra = {tiny_key: {"by_batch": {"8": {"split_p": 4, "num_warps": 1}}}}
        return {**table, "mamba_decode": {**table["mamba_decode"], **extra}}

    monkeypatch.setattr(tuning, "load_table", load_table)
    moe_calls, gemv_calls, skinny_calls = spy_decode_paths(monkeypatch)
    split_launches = Spy(tri_decode._mamba_decode_split_kernel, None)
    walk_launches = Spy(tri_decode._mamba_decode_kernel, None)
    monkeypatch.setattr(tri_decode, "_mamba_decode_split_kernel", split_launches)
    monkeypatch.setattr(tri_decode, "_mamba_decode_kernel", walk_launches)

    llm = LLM(str(ref.model_dir), registry=nemotron_registry(), dtype="float32", device="cpu", max_model_len=128,
              kernel_backend="triton", enforce_eager=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch],
                        SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == ref.tokens[:2]

    assert_decode_paths(moe_calls, gemv_calls, skinny_calls)
    assert not walk_launches.calls and len(split_launches.calls) == 2 * (NEW - 1)  # 2 Mamba layers per decode step
    assert all(grid[1:] == (4, 4) for grid in split_launches.calls)  # (B, heads, 16 rows / 4)


def test_table_configs_compile_for_sm90_and_fit():
    assert_tables_compile_for_sm90(MODELS)
