"""A/B of table decisions that decode CUDA graphs capture (PDL, ``l2_prefetch``, ``moe_align``...) on one engine
(GPU, random weights, default flags): the engine starts once (an FP8 start-up costs minutes), then the settings
take turns, A B A B: each is applied (its environment; ``ARMILLARY_TUNING``'s table through
``tuning.use_env_table``), the decode graphs are captured again, the same greedy requests are decoded (their
tokens must equal the first setting's: these decisions may not change a bit) and N streams' steady
``engine.step()`` is timed. Prints ms a step per setting and stream count, and the medians.

    python bench/decode_ab.py --model qwen --fp8 --streams 1,8,64 \\
        --setting '{}' --setting '{"ARMILLARY_L2_PREFETCH": "1"}'
    python bench/decode_ab.py --model qwen --fp8 --streams 1 --layers 12 --setting '{}' --setting ...  # quicker
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from env_ab import print_medians  # noqa: E402
from profile_step import _model, _steady, _timed_steps  # noqa: E402


def apply(setting: dict[str, str], previous: dict[str, str]) -> None:
    """The setting's environment (the previous one's variables removed) and tuning table; every memo forgotten."""
    from armillary.kernels import tuning
    from armillary.kernels.triton import pdl

    for name in previous:
        os.environ.pop(name, None)
    os.environ.update({k: v for k, v in setting.items() if k != "ARMILLARY_TUNING"})
    tuning.use_env_table(setting.get("ARMILLARY_TUNING", ""))
    pdl._DECIDED.clear()


def recapture(runner) -> None:
    """The decode graphs captured again under the current setting (a fresh pool: the old one is released)."""
    graphs = runner.graphs
    graphs.graphs.clear()
    graphs.outputs.clear()
    graphs.pool = None
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    graphs.capture()


def greedy_tokens(ours, prompts: int, new: int) -> list[list[int]]:
    """``prompts`` fixed requests decoded greedily together: their tokens."""
    from armillary import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    g = torch.Generator().manual_seed(0)  # the same prompts for every setting
    ids = [torch.randint(10, ours.vocab, (300 + 17 * i,), generator=g).tolist() for i in range(prompts)]
    outs = ours.llm.generate([{"prompt_token_ids": p} for p in ids], params)
    return [list(o.outputs[0].token_ids) for o in outs]


@torch.inference_mode()
def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen")
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--streams", default="1,8,64")
    ap.add_argument("--setting", action="append", required=True, help="JSON object of environment variables")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--layers", type=int, default=0, help="keep the first N layers (a shorter start-up; 0: all)")
    args = ap.parse_args()
    settings = [json.loads(text) for text in args.setting]
    streams = [int(s) for s in args.streams.split(",")]
    cfg, Ours = _model(args.model)
    if args.layers:  # every per-layer kernel is still there, fewer times: the ratios hold, the start-up shrinks
        full = cfg["num_hidden_layers"]
        cfg["num_hidden_layers"] = args.layers
        for key, value in cfg.items():  # per-layer lists (layer_types, mlp_layer_types...)
            if isinstance(value, list) and len(value) == full:
                cfg[key] = value[:args.layers]
    import armillary.engine
    armillary.engine.warm_up = lambda engine: None  # the runs below warm what they time
    d = Path(os.environ.get("TMPDIR", "/tmp")) / f"decode_ab_{os.getpid()}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    extra = dict(quantization="fp8_block", kv_cache_dtype="fp8") if args.fp8 else {}
    ours = Ours(d, "cuda", 20480, max(streams + [8]), eager=False, **extra)
    print(f"{args.model}{' fp8' if args.fp8 else ''}: start-up {ours.startup:.1f} s", flush=True)
    times: dict[tuple[str, str], list[float]] = {}  # (setting, "N streams") -> ms a step
    reference, previous, failed = None, {}, 0
    for r in range(args.repeat):
        for i, setting in enumerate(settings):
            apply(setting, previous)
            previous = setting
            recapture(ours.engine.runner)
            tokens = greedy_tokens(ours, 4, 24)
            same = reference is None or tokens == reference
            reference = reference or tokens
            failed += not same
            line = [f"run {r + 1} setting {i} {json.dumps(setting)}: tokens {'equal' if same else 'DIFFER'}"]
            for n in streams:
                rids = _steady(ours, 1024, n)
                ms = _timed_steps(ours.engine, args.steps) * 1e3
                for rid in rids:
                    ours.engine.abort_request(rid)
                ours.engine.step()
                times.setdefault((f"setting {i}", f"{n} streams"), []).append(ms)
                line.append(f"{n} streams {ms:.3f} ms")
            print("; ".join(line), flush=True)
    print_medians(times)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
