"""GPU correctness checks of the fast path (run on the device; prints one line per check).

0. Tiny llama and Mistral (sliding window 24 < the longest prompt): greedy tokens through the
   Triton kernels eagerly and with CUDA-graph decode, batched, equal transformers' (llama plugin).
1. Tiny configs (every case of the plugin's transformers tests): greedy tokens of the reference
   kernels, the Triton kernels eagerly, and the Triton kernels with CUDA-graph decode all equal
   transformers' tokens.
2. Real Qwen3.6-35B-A3B layer shapes (fewer layers, random weights): 256 greedy decode steps through
   the fast path with CUDA graphs; the fp32 reference path then scores the same token sequence and
   the per-step relative logits error ||fast - ref|| / ||ref|| must stay under 1e-2 for the fp32
   fast path. The bf16 fast path is shown beside the bf16 reference kernels, since with random
   weights bf16 rounding alone moves the logits by more than 1e-2.

    python bench/gpu_checks.py --out checks.md
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from armillary import LLM, SamplingParams  # noqa: E402
from armillary.kernels import ops  # noqa: E402
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


def _hf_greedy(model_dir: Path, prompts: list[list[int]], steps: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).cuda().eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            got = hf.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
            outs.append(got[0, len(p):].tolist())
    del hf
    return outs


def llama_checks(lines: list[str]) -> None:
    """Tiny llama and Mistral (window smaller than the prompt) through the Triton kernels with CUDA
    graphs, batched, against transformers' greedy tokens."""
    import armillary_llama.hooks as llama_hooks
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    from armillary.registry import PluginRegistry

    # initializer_range 0.08 (as the Qwen cases): well-separated logits, so TF32 rounding in the
    # Triton fp32 dots cannot flip a greedy near-tie
    common = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.08)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (7, 40, 23, 61)]
    for name, cls, cfg in (("llama", LlamaForCausalLM, LlamaConfig(**common)),
                           ("mistral window 24", MistralForCausalLM, MistralConfig(sliding_window=24, **common))):
        torch.manual_seed(0)
        d = Path(tempfile.mkdtemp())
        cls(cfg).save_pretrained(d)
        ref = _hf_greedy(d, prompts, 32)
        registry = PluginRegistry()
        registry.register(llama_hooks, "llama")
        ok = {}
        for label, kw in (("reference", dict(kernel_backend="reference")), ("triton eager", dict(enforce_eager=True)),
                          ("triton + graphs", {})):
            llm = LLM(str(d), registry=registry, dtype="float32", device="cuda", max_model_len=256, max_num_seqs=8,
                      block_size=16, **kw)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=32, **GREEDY))
            ok[label] = [o.outputs[0].token_ids for o in outs] == ref
            graphs = llm.engine.runner.graphs
            ok[label + " (graphs captured)"] = graphs is not None and bool(graphs.graphs) if label.endswith("graphs") \
                else None
            del llm
            _release()
        lines.append(f"tiny {name}: tokens equal transformers (4 prompts x 32, batched): "
                     f"{ {k: v for k, v in ok.items() if v is not None} }")


def real_shape_config(layers: int) -> dict:
    from transformers import Qwen3_5MoeTextConfig

    d = Qwen3_5MoeTextConfig().to_dict()
    d["layer_types"] = d["layer_types"][:layers]
    d.update(num_hidden_layers=layers, architectures=["Qwen3_5MoeForCausalLM"], dtype="bfloat16")
    return d


def _engine(path: Path, dtype: str, state: dict | None, **kw) -> LLM:
    llm = LLM(str(path), registry=qwen_registry(), load_format="dummy", dtype=dtype, device="cuda",
              max_model_len=2048, max_num_seqs=8, num_kv_blocks=256, **kw)
    if state is not None:
        llm.engine.model.load_state_dict(state)
    return llm


def _release() -> None:
    gc.collect()  # engines hold reference cycles (graphs, runner); free their memory before the next
    torch.cuda.empty_cache()


def _fast_decode(llm: LLM, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and the logits that chose them ([steps, V] on the CPU), CUDA-graph decode."""
    rows: list[torch.Tensor] = []
    inner = llm.engine.model.compute_logits

    def record(h: torch.Tensor) -> torch.Tensor:
        out = inner(h)
        rows.append(out.float().cpu())
        return out

    llm.engine.model.compute_logits = record
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=steps, **GREEDY))[0]
    return out.outputs[0].token_ids, torch.cat(rows)


def _reference_scores(llm: LLM, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The reference kernels' logits at every position that chose ``tokens`` (one prefill)."""
    eng = llm.engine
    batch, _ = eng.single_sequence_batch(prompt + tokens[:-1])
    hidden = eng.model(batch)[len(prompt) - 1:]
    return torch.cat([eng.model.compute_logits(hidden[i:i + 32]).float().cpu() for i in range(0, len(tokens), 32)])


def _rel(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    err = (a - b).norm(dim=-1) / b.norm(dim=-1)
    return err.max().item(), err.mean().item()


@torch.inference_mode()
def real_shape_check(lines: list[str], layers: int, steps: int, router_scale: float) -> None:
    """fp32 fast path vs fp32 reference (kernel correctness; < 1e-2), and bf16 fast path vs fp32
    reference next to the bf16 reference vs fp32 reference (what bf16 rounding alone costs).

    ``router_scale`` multiplies the random router weights: at the dummy init the router logits have a
    std of ~0.5, so the 8th and 9th experts are ~0.04 apart and a 1e-6 difference between two correct
    fp32 paths sometimes swaps them; the recurrent states then carry that swap to every later step.
    Trained routers are far more decisive; a larger scale keeps the comparison about the kernels.
    """
    d = Path(tempfile.mkdtemp())
    (d / "config.json").write_text(json.dumps(real_shape_config(layers)))
    prompt = torch.randint(10, 150000, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    fast32 = _engine(d, "float32", None)
    state = {k: v.cpu() * (router_scale if k.endswith("mlp.gate.weight") else 1.0)
             for k, v in fast32.engine.model.state_dict().items()}
    fast32.engine.model.load_state_dict(state)
    tokens32, fast32_logits = _fast_decode(fast32, prompt, steps)
    del fast32
    _release()
    fast16 = _engine(d, "bfloat16", state)
    tokens16, fast16_logits = _fast_decode(fast16, prompt, steps)
    del fast16
    _release()
    ref32 = _engine(d, "float32", state, kernel_backend="reference")
    ref32_on32 = _reference_scores(ref32, prompt, tokens32)
    ref32_on16 = _reference_scores(ref32, prompt, tokens16)
    del ref32
    _release()
    ref16 = _engine(d, "bfloat16", state, kernel_backend="reference")
    ref16_on16 = _reference_scores(ref16, prompt, tokens16)
    del ref16
    _release()
    worst, mean = _rel(fast32_logits, ref32_on32)
    shape = f"{layers} layers of Qwen3.6-35B-A3B, random weights, router x{router_scale:g}, {steps} CUDA-graph decode steps"
    lines.append(f"real shape ({shape}): fp32 fast path vs fp32 reference: max relative logits error "
                 f"{worst:.2e} (mean {mean:.2e}) {'PASS' if worst < 1e-2 else 'FAIL'} (< 1e-2)")
    w16, m16 = _rel(fast16_logits, ref32_on16)
    wb, mb = _rel(ref16_on16, ref32_on16)
    lines.append(f"real shape, router x{router_scale:g}: bf16 fast path vs fp32 reference: max {w16:.2e} (mean {m16:.2e}); "
                 f"bf16 reference kernels vs fp32 reference on the same tokens: max {wb:.2e} (mean {mb:.2e})")
    ops.set_backend("auto")


@torch.inference_mode()
def sdpa_prefill_check(lines: list[str]) -> None:
    """Fresh-prompt prefill through cuDNN / flash SDPA vs the Triton paged prefill and the fp32
    reference, at the Qwen3.6 attention shape (16 / 2 heads x 256, page 16, bf16)."""
    from armillary.forward_batch import KVCache
    from armillary.kernels.attention import paged_attention, write_kv
    from armillary.kernels.sdpa_prefill import fresh_prefill_attention
    from armillary.kernels.triton.paged_attention import paged_attention_prefill

    for lengths in ([2048], [16384], [3000, 1500, 1100]):
        total, page, hq, hkv, d = sum(lengths), 16, 16, 2, 256
        blocks = [-(-n // page) for n in lengths]
        perm = torch.randperm(sum(blocks) + 8, generator=torch.Generator().manual_seed(1)).tolist()
        tables, slots, at = [], [], 0
        for n, nb in zip(lengths, blocks):
            table = perm[at:at + nb]
            at += nb
            tables.append(table + [0] * (max(blocks) - nb))
            slots += [table[p // page] * page + p % page for p in range(n)]
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(total, h, d, device="cuda", generator=g, dtype=torch.bfloat16) for h in (hq, hkv, hkv))
        cache = KVCache(*(torch.zeros(len(perm), page, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2)))
        write_kv(cache, k, v, torch.tensor(slots, device="cuda"))
        bt = torch.tensor(tables, dtype=torch.int32, device="cuda")
        qsl = [0]
        for n in lengths:
            qsl.append(qsl[-1] + n)
        scale = d**-0.5
        fast = fresh_prefill_attention(q, cache, bt, qsl, scale)
        tri = paged_attention_prefill(q, cache.k, cache.v, bt, torch.tensor(qsl, dtype=torch.int32, device="cuda"),
                                      torch.tensor(lengths, dtype=torch.int32, device="cuda"), max(lengths), scale)
        if fast is None:
            lines.append(f"sdpa prefill {lengths}: no SDPA backend took the shape (Triton path used)")
            continue
        err = ((fast.float() - tri.float()).abs().max() / tri.float().abs().max()).item()
        msg = f"sdpa prefill {lengths}: vs Triton paged prefill max|err|/max|ref| {err:.2e}"
        if total <= 4096:
            cache32 = KVCache(cache.k.float(), cache.v.float())
            ref = paged_attention(q.float(), cache32, bt, qsl, lengths, scale)
            err32 = ((fast.float() - ref).abs().max() / ref.abs().max()).item()
            tri32 = ((tri.float() - ref).abs().max() / ref.abs().max()).item()
            msg += f"; vs fp32 reference {err32:.2e} (Triton's own {tri32:.2e})"
        lines.append(msg)


class _Echo(list):
    """The result lines, each also printed as it comes (a check cut off by a time limit keeps the rest)."""

    def append(self, line: str) -> None:
        print(line, flush=True)
        super().append(line)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--skip-tiny", action="store_true")
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--router-scales", type=float, nargs="*", default=[1.0, 20.0], help="none: skip the real-shape check")
    args = ap.parse_args()
    lines: list[str] = _Echo()
    sdpa_prefill_check(lines)
    if not args.skip_llama:
        llama_checks(lines)
    if not args.skip_tiny:
        tiny_checks(lines)
    for scale in args.router_scales:
        real_shape_check(lines, args.layers, args.steps, scale)
    text = "\n".join(lines)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
