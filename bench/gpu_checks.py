"""GPU correctness checks of the fast path (run on the device; prints one line per check).

1. Tiny configs (every case of the plugin's transformers tests): greedy tokens of the reference
   kernels, the Triton kernels eagerly, and the Triton kernels with CUDA-graph decode all equal
   transformers' tokens.
2. Real Qwen3.6-35B-A3B layer shapes (fewer layers, random weights): 256 greedy decode steps through
   the bf16 fast path with CUDA graphs; the fp32 reference path then scores the same token sequence
   and the per-step relative logits error ||fast - ref|| / ||ref|| must stay under 1e-2.

    python bench/gpu_checks.py --out checks.md
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from armillary import LLM, SamplingParams  # noqa: E402
from armillary.kernels import ops  # noqa: E402
from armillary.sequence import Sequence  # noqa: E402
from plugins.qwen_gdn_moe.tests.harness import qwen_registry  # noqa: E402
from plugins.qwen_gdn_moe.tests.hf_models import CASES, make_reference  # noqa: E402

GREEDY = dict(temperature=0.0, ignore_eos=True)


def tiny_checks(lines: list[str]) -> None:
    for case in CASES:
        ref = make_reference(case, Path(tempfile.mkdtemp()))
        prompts = [{"prompt_token_ids": p} for p in ref.prompts]
        got = {}
        for label, kw in (("reference", dict(kernel_backend="reference")),
                          ("triton eager", dict(enforce_eager=True)), ("triton + graphs", {})):
            llm = LLM(str(ref.model_dir), registry=qwen_registry(), dtype="float32", device="cuda",
                      max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, **kw)
            outs = llm.generate(prompts, SamplingParams(max_tokens=len(ref.tokens[0]), **GREEDY))
            got[label] = [o.outputs[0].token_ids for o in outs]
            del llm
            torch.cuda.empty_cache()
        ok = {k: v == ref.tokens for k, v in got.items()}
        lines.append(f"tiny {case.name}: tokens equal transformers: {ok}")
    ops.set_backend("auto")


def real_shape_config(layers: int) -> dict:
    from transformers import Qwen3_5MoeTextConfig

    d = Qwen3_5MoeTextConfig().to_dict()
    d["layer_types"] = d["layer_types"][:layers]
    d.update(num_hidden_layers=layers, architectures=["Qwen3_5MoeForCausalLM"], dtype="bfloat16")
    return d


@torch.inference_mode()
def real_shape_check(lines: list[str], layers: int, steps: int) -> None:
    d = Path(tempfile.mkdtemp())
    (d / "config.json").write_text(json.dumps(real_shape_config(layers)))
    common = dict(registry=qwen_registry(), load_format="dummy", device="cuda", max_model_len=2048, max_num_seqs=8)
    fast = LLM(str(d), dtype="bfloat16", **common)
    prompt = torch.randint(10, 150000, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    rows: list[torch.Tensor] = []
    inner = fast.engine.model.compute_logits
    fast.engine.model.compute_logits = lambda h: rows.append(inner(h).float().cpu()) or rows[-1].to(h.device)
    t = time.perf_counter()
    out = fast.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=steps, **GREEDY))[0]
    dt = time.perf_counter() - t
    tokens = out.outputs[0].token_ids
    state = {k: v.float() for k, v in fast.engine.model.state_dict().items()}
    del fast
    torch.cuda.empty_cache()
    ref = LLM(str(d), dtype="float32", kernel_backend="reference", **common)
    ref.engine.model.load_state_dict(state)
    del state
    seq = Sequence("ref", 0, prompt + tokens[:-1], SamplingParams())
    seq.state_slot = ref.engine.states.allocate()
    seq.num_new_tokens = len(seq)
    ref.engine.blocks.grow(seq, len(seq))
    batch, _ = ref.engine.runner.prepare([seq])
    hidden = ref.engine.model(batch)[len(prompt) - 1:]  # the positions whose logits sampled each token
    errs = []
    for i in range(0, steps, 32):
        ref_logits = ref.engine.model.compute_logits(hidden[i:i + 32]).cpu()
        fast_logits = torch.cat(rows[i:i + 32])
        errs += ((fast_logits - ref_logits).norm(dim=-1) / ref_logits.norm(dim=-1)).tolist()
    worst = max(errs)
    lines.append(f"real shape ({layers} layers of Qwen3.6-35B-A3B, bf16 fast path + graphs vs fp32 reference), "
                 f"{steps} decode steps: max relative logits error {worst:.2e} (mean {sum(errs) / len(errs):.2e}); "
                 f"{'PASS' if worst < 1e-2 else 'FAIL'} (< 1e-2); fast generate took {dt:.1f} s")
    ops.set_backend("auto")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--skip-tiny", action="store_true")
    args = ap.parse_args()
    lines: list[str] = []
    if not args.skip_tiny:
        tiny_checks(lines)
    real_shape_check(lines, args.layers, args.steps)
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
