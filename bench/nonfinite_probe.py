"""Where a model's numbers turn non-finite: forward hooks on every module, the first offender of each step named.

For a logits row that comes back NaN / inf (issue 13's logits phase: the reference backend's rows on the GPU). The
engine runs eagerly (hooks see every module call), greedy one-token requests teacher-forced on a growing history
(prefix caching turns each into a one-token step, as the logits phase does). Prints the parameters that are not
finite, then per step: the token, whether the logits row is finite, and the first module (in call order) whose
output is not, with its inputs' shapes, dtypes, largest magnitudes and finiteness.

    python bench/nonfinite_probe.py --model qwen --fp8 --backend reference --prefix-caching
    python bench/nonfinite_probe.py --model qwen --tiny --device cpu --backend reference   # the driver itself
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_step import _model  # noqa: E402


def describe(t: torch.Tensor) -> tuple:
    """(shape, dtype, max |x| over the finite entries, all finite) of a floating tensor; (shape, dtype) else."""
    if not t.is_floating_point() or t.numel() == 0:
        return tuple(t.shape), str(t.dtype)
    finite = torch.isfinite(t if t.element_size() > 1 else t.float())
    peak = t.float().abs().masked_fill(~finite, 0).max().item()
    return tuple(t.shape), str(t.dtype), peak, bool(finite.all())


class FirstNonFinite:
    """Forward hooks on every module of ``model``; ``found`` holds the first non-finite output since ``clear``."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.found: list[tuple] = []
        self.handles = [m.register_forward_hook(self._hook(name)) for name, m in model.named_modules()]

    def _hook(self, name: str):
        def check(module, inputs, output) -> None:
            if self.found:
                return
            out = output[0] if isinstance(output, (tuple, list)) and output else output
            if isinstance(out, torch.Tensor) and out.is_floating_point() and not torch.isfinite(out).all():
                self.found.append((name, type(module).__name__, describe(out),
                                   [describe(i) for i in inputs if isinstance(i, torch.Tensor)]))
        return check

    def clear(self) -> None:
        self.found.clear()

    def close(self) -> None:
        for h in self.handles:
            h.remove()


@torch.inference_mode()
def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen")
    ap.add_argument("--tiny", action="store_true", help="the driver's tiny config (checks the probe itself)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--fp8", action="store_true", help="fp8_block weights and fp8 KV, as fp8_bench.py")
    ap.add_argument("--backend", default="reference")
    ap.add_argument("--prefix-caching", action="store_true")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    from armillary import SamplingParams
    from armillary.testing import LogitsRecorder

    if args.tiny and args.model == "qwen":
        from qwen_bench import Ours, real_config
        cfg = real_config(True)
    else:
        cfg, Ours = _model(args.model)
    extra = dict(quantization="fp8_block", kv_cache_dtype="fp8") if args.fp8 else {}
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(cfg))
        ours = Ours(Path(d), args.device, 2048, 1, True, kernel_backend=args.backend,
                    enable_prefix_caching=args.prefix_caching, **extra)
        print(f"start-up {ours.startup:.1f} s", flush=True)
        model = ours.engine.model
        bad = [n for n, p in model.named_parameters()  # fp8 weights have no inf: widened to check for NaN
               if p.is_floating_point() and not torch.isfinite(p if p.element_size() > 1 else p.float()).all()]
        print(f"non-finite parameters: {len(bad)} {bad[:8]}", flush=True)
        probe, rec = FirstNonFinite(model), LogitsRecorder(model)
        prompt = torch.randint(10, ours.vocab, (args.prompt,), generator=torch.Generator().manual_seed(7)).tolist()
        one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        history: list[int] = []
        for step in range(args.steps):
            probe.clear()
            token = ours.llm.generate([prompt + history], one)[0].outputs[0].token_ids[0]
            row = rec.take()[-1].float()
            print(f"step {step}: token {token}, logits finite {bool(torch.isfinite(row).all())}, first non-finite "
                  f"{probe.found[0] if probe.found else None}", flush=True)
            history.append(token)
        probe.close()
        rec.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
