"""GPU check of speculative decoding as a user runs it (``LLM(..., speculative=True)``, default flags):
tiny Qwen3-Next / Qwen3.5-MoE checkpoints with an MTP head, greedy output with speculation on
(MTP drafts through the verify CUDA graphs and eagerly, and oracle drafts that are partly right)
against it off (CUDA graphs). One line per check.

    python bench/speculative_gpu_check.py --out checks.txt      # on the GPU (needs transformers)
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plugins.qwen_gdn_moe.tests.harness import qwen_registry  # noqa: E402
from plugins.qwen_gdn_moe.tests.hf_models import CASES_BY_NAME, VOCAB, prompts  # noqa: E402
from plugins.qwen_gdn_moe.tests.mtp_checkpoint import save_with_mtp  # noqa: E402
from tests.fixtures.oracle_drafts import OracleProposer, oracle_reference  # noqa: E402


def generate(path: Path, dtype: str, oracle: dict | None = None, **kw) -> tuple[list[list[int]], dict]:
    from armillary import LLM, SamplingParams

    llm = LLM(str(path), registry=qwen_registry(), dtype=dtype, max_model_len=512, max_num_seqs=8, **kw)
    if oracle is not None:
        runner = llm.engine.runner
        runner.proposer = OracleProposer(runner.proposer, oracle, VOCAB)
    ps = prompts()
    outs = llm.generate([{"prompt_token_ids": p} for p in ps],
                        SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs], llm.engine.stats()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--drafts", default="1,2,3", help="the K values")
    args = ap.parse_args()
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in ("next_full_last", "moe35_cg"):
            path = save_with_mtp(CASES_BY_NAME[case], Path(tmp) / case)
            for dtype in args.dtypes.split(","):
                base, _ = generate(path, dtype)
                oracle = oracle_reference(prompts(), base)
                eager, _ = generate(path, dtype, enforce_eager=True)
                same = sum(a == b for a, b in zip(eager, base))
                lines.append(f"{case} {dtype} no speculation, eager vs CUDA graphs: {same}/{len(base)} identical")
                print(lines[-1], flush=True)
                for k in (int(k) for k in args.drafts.split(",")):
                    # the oracle replaces the proposer after start-up, which captured graphs would not see: eager
                    for name, kw in (("mtp graphs", {}), ("mtp eager", {"enforce_eager": True}),
                                     ("oracle eager", {"oracle": oracle, "enforce_eager": True})):
                        got, stats = generate(path, dtype, speculative=True, num_drafts=k, **kw)
                        same = sum(a == b for a, b in zip(got, base))
                        first = min((next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                                     for a, b in zip(got, base)), default=0)
                        lines.append(f"{case} {dtype} K={k} {name}: {same}/{len(base)} identical "
                                     f"(first divergence at token {first}), tokens/step "
                                     f"{stats['spec_tokens_per_step']:.2f}, accepted {stats['num_accepted_tokens']}")
                        print(lines[-1], flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
