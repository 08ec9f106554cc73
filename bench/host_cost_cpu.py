"""Host time of an eager Qwen3.6-layout step, measured on the CPU: the GPU machines' hosts differ too much to compare.

An eager step (any step with a prefill chunk) is bound by its host work at short prompts: ~550 Triton launches
and their wrappers, ~120 GEMMs, ~800 allocations. The lent GPU machines' hosts differed by up to 1.8x in Python
speed between calls (``bench/RESULTS.md``, fifteenth session), so a change to the wrappers is compared here
first: the real engine and model code on the "triton" kernel backend, with every Triton launch and every
``F.linear`` replaced by a no-op (outputs are garbage; nothing on the host reads them), on a checkpoint with
the served model's layer layout (40 layers, 3 GDN : 1 attention, 256 experts top 8) at tiny widths. What is
left is our own Python and torch's op dispatch. Prints the best and median host ms per request over blocks of
requests, and with ``--profile`` the cProfile tables of the engine's own functions.

    python bench/host_cost_cpu.py [--tokens 64] [--layers 40] [--blocks 6] [--per-block 8] [--profile]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # kernels are defined as interpreted functions: their launch is stubbed below
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _stub_launches() -> dict:
    """Every Triton launch and every F.linear becomes a no-op; returns the launch counter."""
    import torch
    import torch.nn.functional as F
    from triton.runtime import interpreter

    count = {"launches": 0}

    def launch(self, *args, grid=None, warmup=False, **kwargs):
        count["launches"] += 1

    def linear(x, w, b=None):
        return torch.empty(*x.shape[:-1], w.shape[0], dtype=x.dtype)

    interpreter.InterpretedFunction.run = launch
    F.linear = linear
    return count


def _checkpoint(path: Path, layers: int) -> None:
    import torch
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForCausalLM

    cfg = Qwen3_5MoeTextConfig(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=32, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=16,
                               linear_value_head_dim=16, num_experts=256, num_experts_per_tok=8,
                               moe_intermediate_size=32, shared_expert_intermediate_size=32, vocab_size=512,
                               max_position_embeddings=8192)
    cfg.architectures = ["Qwen3_5MoeForCausalLM"]
    torch.manual_seed(0)
    Qwen3_5MoeForCausalLM(cfg).save_pretrained(path)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64, help="prompt tokens (one fresh prompt per request)")
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--per-block", type=int, default=8)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    count = _stub_launches()
    from armillary import LLM, SamplingParams
    from plugins.qwen_gdn_moe.tests.harness import qwen_registry

    with tempfile.TemporaryDirectory() as tmp:
        _checkpoint(Path(tmp), args.layers)
        llm = LLM(tmp, registry=qwen_registry(), dtype="float32", device="cpu", max_model_len=8192,
                  kernel_backend="triton", enforce_eager=True)
        prompt = [{"prompt_token_ids": list(range(1, args.tokens + 1))}]
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

        def request() -> None:
            llm.generate(prompt, params)

        for _ in range(3):
            request()
        count["launches"] = 0
        blocks = []
        for _ in range(args.blocks):
            t = time.perf_counter()
            for _ in range(args.per_block):
                request()
            blocks.append((time.perf_counter() - t) / args.per_block * 1e3)
        launches = count["launches"] / (args.blocks * args.per_block)
        print(f"prefill {args.tokens} tokens, {args.layers} layers: host {min(blocks):.2f} ms best, "
              f"{statistics.median(blocks):.2f} ms median per request; {launches:.0f} Triton launches", flush=True)
        if args.profile:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            for _ in range(5):
                request()
            prof.disable()
            stats = pstats.Stats(prof)
            stats.sort_stats("tottime").print_stats(30)
            stats.sort_stats("cumulative").print_stats("core/|armillary", 40)
        llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
