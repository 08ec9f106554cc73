"""An FP8 block-wise checkpoint (as published: ``weight_scale_inv`` per 16 x 16 block here, 128 x 128 on
the hub) of a tiny Nemotron-H, against the same model with the dequantized weights in fp32: greedy
tokens identical, top log-probabilities close. Every projection is quantized (Mamba in/out, q/k/v/o,
routed experts, the stacked shared expert, the dense relu² MLP); router, embeddings and head are not."""
from __future__ import annotations

import json
import re

import torch
from safetensors.torch import load_file, save_file

from armillary import LLM, SamplingParams
from plugins.nemotron.tests.hf_models import CASES_BY_NAME, build_hf_model, nemotron_registry

E4M3_MAX = 448.0
BLOCK = 16
NOT_CONVERTED = ["lm_head", "embeddings", "mixer.gate"]


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per BLOCK x BLOCK block: scale = amax / 448, w ≈ q · scale."""
    n, k = w.shape
    rows, cols = -(-n // BLOCK), -(-k // BLOCK)
    padded = torch.zeros(rows * BLOCK, cols * BLOCK)
    padded[:n, :k] = w.float()
    blocks = padded.reshape(rows, BLOCK, cols, BLOCK)
    scale = (blocks.abs().amax(dim=(1, 3)) / E4M3_MAX).clamp_min(1e-12)  # [rows, cols]
    q = (blocks / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(rows * BLOCK, cols * BLOCK)[:n, :k].contiguous(), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    full = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[: q.shape[0], : q.shape[1]]
    return q.float() * full


def _generate(model_dir) -> tuple[list[list[int]], list[torch.Tensor]]:
    llm = LLM(str(model_dir), registry=nemotron_registry(), dtype="float32", max_model_len=128, device="cpu")
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=5, ignore_eos=True)
    outs = llm.generate([[5, 17, 42, 7, 99, 3, 11, 60, 1, 200, 33], [250, 1, 1, 80]], params)
    tokens = [o.outputs[0].token_ids for o in outs]
    lps = [torch.tensor([[lp for _, lp in step.top] for step in o.outputs[0].logprobs]) for o in outs]
    return tokens, lps


def test_fp8_block_checkpoint_equals_its_dequantized_model(tmp_path):
    src = tmp_path / "src"
    build_hf_model(CASES_BY_NAME["ME*ME_groups2_chunk8"]).save_pretrained(src)
    tensors = load_file(str(src / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    quant, deq = {}, {}
    for name, t in tensors.items():
        if not re.search(r"_proj\.weight$", name) or any(e in name for e in NOT_CONVERTED):
            quant[name] = deq[name] = t
            continue
        q, s = quantize(t)
        quant[name], quant[name.removesuffix("weight") + "weight_scale_inv"] = q, s
        deq[name] = dequantize(q, s)
    assert sum(n.endswith("weight_scale_inv") for n in quant) >= 10
    assert any("shared_experts.up_proj.weight_scale_inv" in n for n in quant)
    qcfg = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [BLOCK, BLOCK], "modules_to_not_convert": NOT_CONVERTED}
    for d, t, c in ((tmp_path / "fp8", quant, {**config, "quantization_config": qcfg}),
                    (tmp_path / "deq", deq, config)):
        d.mkdir()
        (d / "config.json").write_text(json.dumps(c))
        save_file(t, str(d / "model.safetensors"))
    fp8_tokens, fp8_lps = _generate(tmp_path / "fp8")
    deq_tokens, deq_lps = _generate(tmp_path / "deq")
    assert fp8_tokens == deq_tokens
    for a, b in zip(fp8_lps, deq_lps):
        assert (a - b).abs().max() < 5e-2  # activations are quantized per token group at run time
