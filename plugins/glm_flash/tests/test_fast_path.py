"""The whole model through the Triton kernels (the GPU fast path: the absorbed MLA decode kernel, core's norms,
rotary, router and MoE) equals transformers. Without CUDA the kernels run in Triton's interpreter."""
from __future__ import annotations

import pytest
import torch

from armillary import LLM, SamplingParams
from armillary.kernels import ops
from plugins.glm_flash.tests.harness import glm_registry
from plugins.glm_flash.tests.hf_models import CASES_BY_NAME, make_reference
from tests.fixtures.logits_recorder import LogitsRecorder

NEW = 8


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter evaluates masked-off lanes too
@pytest.mark.parametrize("name", ["lora_interleaved", "grouped_routing"])  # grouped: core's Triton group-limited router
def test_triton_kernels_match_transformers(name, tmp_path):
    ref = make_reference(CASES_BY_NAME[name], tmp_path)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # a 40-token budget mixes chunked prefills with decodes, then runs decode-only steps
    llm = LLM(str(ref.model_dir), registry=glm_registry(), dtype="float32", device=device, max_model_len=256,
              max_num_batched_tokens=40, kernel_backend="triton", enforce_eager=True)
    try:
        rec = LogitsRecorder(llm.engine.model)
        outs = llm.generate([{"prompt_token_ids": p} for p in ref.prompts],
                            SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
        assert [o.outputs[0].token_ids for o in outs] == [t[:NEW] for t in ref.tokens]
        assert len(rec.rows) == NEW * len(ref.prompts)
    finally:
        ops.set_backend("auto")
