"""GPU check of penalties with async scheduling and speculation (issues 12, 17): exact tokens, async steps, accepted drafts, tok/s.

Qwen3.5 / 3.6 chat defaults carry ``presence_penalty 1.5``; penalties must keep async scheduling
and draft acceptance on. Part 1, tiny Qwen3-Next checkpoints with an MTP head (float32): greedy
tokens with each penalty kind and min_tokens, async scheduling on (the CUDA default) equal to it
off, continuations launched; speculation K = 1, 2, 3 with oracle drafts equal to none, drafts
accepted. Part 2, the Qwen3.6-35B-A3B shape (random bf16 weights, CUDA graphs): decode tok/s with
presence 1.5 against none (async steps counted), and with ``--speculative`` in forced-accept mode
the tokens per verify step with presence 1.5 (K + 1 when nothing caps acceptance). One line per
figure; JSON to ``$OUT/penalties.json``.

    python bench/penalties_gpu_check.py                        # on the GPU
    python bench/penalties_gpu_check.py --tiny --device cpu    # the driver on the CPU
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from plugins.qwen_gdn_moe.tests.harness import qwen_registry  # noqa: E402
from plugins.qwen_gdn_moe.tests.hf_models import CASES_BY_NAME, VOCAB, prompts  # noqa: E402
from plugins.qwen_gdn_moe.tests.mtp_checkpoint import save_with_mtp  # noqa: E402
from tests.fixtures.oracle_drafts import OracleProposer, oracle_reference  # noqa: E402

FIGURES: dict[str, float] = {}


def report(name: str, value: float) -> None:
    FIGURES[name] = value
    print(f"{name}: {value:.4g}", flush=True)


def check(name: str, ok: bool) -> None:
    FIGURES[name] = float(ok)
    print(f"{name}: {'PASS' if ok else 'FAIL'}", flush=True)


def _work():
    from armillary import SamplingParams

    base = dict(temperature=0.0, max_tokens=24, ignore_eos=True)
    kinds = [dict(presence_penalty=1.5), dict(presence_penalty=-2.0), dict(frequency_penalty=-1.5),
             dict(repetition_penalty=0.3), dict(presence_penalty=1.0, frequency_penalty=-1.0, repetition_penalty=0.5)]
    params = [SamplingParams(**kind, **base) for kind in kinds]
    params.append(SamplingParams(temperature=0.0, max_tokens=24, min_tokens=12, presence_penalty=1.5))
    ps = [p[:40] for p in prompts()] + [[7, 8, 9], [20, 21, 22]]
    return ps, params


def _generate(path: Path, device: str, ps, params, oracle=None, **kw):
    from armillary import LLM

    llm = LLM(str(path), registry=qwen_registry(), dtype="float32", device=device, max_model_len=512,
              max_num_seqs=8, **kw)
    if oracle is not None:
        runner = llm.engine.runner
        runner.proposer = OracleProposer(runner.proposer, oracle, VOCAB)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    stats = llm.engine.stats()
    llm.shutdown()
    return tokens, stats


def exactness(device: str) -> None:
    ps, params = _work()
    with tempfile.TemporaryDirectory() as tmp:
        path = save_with_mtp(CASES_BY_NAME["next_full_last"], Path(tmp))
        sync, _ = _generate(path, device, ps, params, async_scheduling=False)
        fast, stats = _generate(path, device, ps, params, async_scheduling=True)
        check("tiny: penalties + min_tokens, async tokens == sync tokens", fast == sync)
        report("tiny: async steps with penalties", stats["num_async_steps"])
        oracle = oracle_reference(ps, sync)
        for k in (1, 2, 3):
            spec, stats = _generate(path, device, ps, params, oracle=oracle, speculative=True, num_drafts=k)
            check(f"tiny: penalties + min_tokens, K={k} oracle drafts == no speculation", spec == sync)
            report(f"tiny: K={k} accepted drafts with penalties", stats["num_accepted_tokens"])
            report(f"tiny: K={k} tokens per verify step", stats["spec_tokens_per_step"])


def _decode(engine, batch: int, prompt: int, new: int, params, tag: str) -> tuple[float, int]:
    """``batch`` requests at once; decode tok/s after the last first token, and async steps taken."""
    import torch

    g = torch.Generator().manual_seed(prompt + batch)
    vocab = min(engine.structured.vocab_size, 150000)
    for i in range(batch):
        engine.add_request(f"{tag}{i}", torch.randint(10, vocab, (prompt,), generator=g).tolist(), params)
    before = engine.num_async_steps
    first: set[str] = set()
    counts: dict[str, int] = {}
    start = tokens_at = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            counts[o.request_id] = len(o.outputs[0].token_ids)
            first.add(o.request_id)
        if start is None and len(first) == batch:
            start, tokens_at = time.perf_counter(), sum(counts.values())
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    decoded = sum(counts.values()) - tokens_at
    return decoded / (time.perf_counter() - start), engine.num_async_steps - before


def speed(device: str, tiny: bool) -> None:
    import gc

    import torch

    from armillary import SamplingParams
    from qwen_bench import Ours, real_config

    cfg = real_config(tiny)
    cfg["mtp_num_hidden_layers"] = 1
    prompt, new = (32, 16) if tiny else (1024, 256)
    plain = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    penal = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, presence_penalty=1.5)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        (path / "config.json").write_text(json.dumps(cfg))
        ours = Ours(path, device, 4096, 64, eager=device != "cuda",
                    **({"async_scheduling": True} if device != "cuda" else {}))
        eng = ours.engine
        _decode(eng, 1, 64, 8, penal, "w")  # warm-up
        for batch in (1, 8):
            rate, _ = _decode(eng, batch, prompt, new, plain, f"p{batch}_")
            rate_pen, steps = _decode(eng, batch, prompt, new, penal, f"q{batch}_")
            report(f"b{batch} decode tok/s, no penalty", rate)
            report(f"b{batch} decode tok/s, presence 1.5", rate_pen)
            report(f"b{batch} presence 1.5 / no penalty", rate_pen / rate)
            report(f"b{batch} async steps with presence 1.5 (of {new})", steps)
        ours.llm.shutdown()
        del ours, eng
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        for k in (2,):
            spec = Ours(path, device, 4096, 64, eager=False, speculative=True, num_drafts=k)
            eng = spec.engine
            eng.runner.speculative.force_accept = True  # random weights draft garbage: accept what may be
            _decode(eng, 1, 64, 8, penal, "w")
            before = dict(eng.stats())
            rate_pen, _ = _decode(eng, 1, prompt, new, penal, "s")
            after = eng.stats()
            seqs = (after["num_draft_tokens"] - before["num_draft_tokens"]) / k
            emitted = after["num_emitted_tokens"] - before["num_emitted_tokens"]
            report(f"K={k} forced accept, presence 1.5: tokens per verify step (K+1 = {k + 1} wanted)",
                   emitted / max(1, seqs))
            report(f"K={k} forced accept, presence 1.5: b1 tok/s", rate_pen)
            spec.llm.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a tiny config for part 2: checks the driver only")
    ap.add_argument("--skip-speed", action="store_true")
    args = ap.parse_args()
    exactness(args.device)
    if not args.skip_speed:
        speed(args.device, args.tiny)
    out = os.environ.get("OUT")
    if out:
        Path(out, "penalties.json").write_text(json.dumps(FIGURES, indent=1))


if __name__ == "__main__":
    main()
