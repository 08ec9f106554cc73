"""The decode GEMM and MoE shapes each benchmarked model asks for, read off the plugin's model built on the meta device.

``linear_shapes(model)``: {(N, K): [layer names]} of every ``ops.linear`` a decode step makes (the
stacked linear layers, and the head where the model computes logits through ``ops.linear``);
``moe_shapes(model)``: the distinct ``FusedMoE`` operand shapes (experts incl. the stacked shared
ones, pairs per token, H, I, activation, gated); ``gemma_fused_gemv_shapes(model)``: the gemma plugin's
fused decode GEMVs (GeGLU down projections, the soft-capped head). The configs are the benches' own (``nano_config``,
``real_config``, ``GEMMA4_26B_A4B`` / ``GEMMA3_27B``, Qwen3.6-35B-A3B), so the sweeps
(``skinny_gemm.py`` / ``moe_gemv.py --model``) and the table tests see the same shapes.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

MODELS = ("qwen", "nemotron", "glm", "gemma4", "gemma3")
PACKAGES = {"qwen": "armillary_qwen_gdn_moe", "nemotron": "armillary_nemotron", "glm": "armillary_glm_flash",
            "gemma4": "armillary_gemma", "gemma3": "armillary_gemma"}
QWEN36 = {  # Qwen3.6-35B-A3B text config (MODELS.md), the shapes qwen_gdn_moe's tables carry
    "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text", "vocab_size": 248320,
    "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16, "num_key_value_heads": 2,
    "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 256, "num_experts_per_tok": 8,
    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "full_attention_interval": 4,
    "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-6, "dtype": "bfloat16",
}


@dataclass(frozen=True, slots=True)
class MoeShape:
    experts: int  # routed + stacked shared
    shared: int  # always-on experts, ids experts - shared ..
    pairs: int  # (token, expert) pairs per token: top-k + shared
    hidden: int
    inter: int
    activation: str
    gated: bool


def hf_config(model: str) -> dict:
    """The bench's config.json dict of ``model`` (JSON round trip: string keys, as a checkpoint's)."""
    if model == "nemotron":
        from nemotron_bench import nano_config

        cfg = nano_config(False)
    elif model == "glm":
        from glm_flash_bench import real_config

        cfg = real_config(False)
    elif model in ("gemma4", "gemma3"):
        from gemma_bench import GEMMA3_27B, GEMMA4_26B_A4B

        cfg = GEMMA4_26B_A4B if model == "gemma4" else GEMMA3_27B
    elif model == "qwen":
        cfg = QWEN36
    else:
        raise ValueError(f"model {model!r} not in {MODELS}")
    return json.loads(json.dumps(cfg))


def meta_model(model: str) -> torch.nn.Module:
    """The plugin's model at the real size on the meta device (no memory, no weights)."""
    from armillary.hf_config import HFConfig
    from armillary.registry import default_registry

    cfg = hf_config(model)
    arch = default_registry().resolve_architecture(cfg["architectures"])
    module, _, name = arch.model_cls.partition(":")
    cls = getattr(__import__(module, fromlist=[name]), name)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            return cls(HFConfig(cfg))
    finally:
        torch.set_default_dtype(saved)


def _head_through_ops(model: str, net: torch.nn.Module) -> tuple[int, int] | None:
    """Gemma computes its (tied) logits with ``ops.linear``; the others through ``LMHead`` (cuBLAS)."""
    if model not in ("gemma4", "gemma3"):
        return None
    weight = net.model.embed_tokens.weight if net.lm_head is None else net.lm_head.weight
    return tuple(weight.shape)


def linear_shapes(model: str) -> dict[tuple[int, int], list[str]]:
    """{(N, K): sorted layer-name suffixes} of the model's decode ``ops.linear`` calls."""
    from armillary.layers.linear import LinearBase

    net = meta_model(model)
    shapes: dict[tuple[int, int], set[str]] = {}
    for name, mod in net.named_modules():
        if isinstance(mod, LinearBase):
            key = (mod.output_size_per_partition, mod.input_size_per_partition)
            shapes.setdefault(key, set()).add(name.rsplit(".", 1)[-1])
    head = _head_through_ops(model, net)
    if head is not None:
        shapes.setdefault(head, set()).add("lm_head")
    return {k: sorted(v) for k, v in sorted(shapes.items())}


def moe_shapes(model: str) -> list[MoeShape]:
    """The distinct routed-expert operand shapes of the model (empty for a dense model)."""
    from armillary.layers import FusedMoE

    found = set()
    for mod in meta_model(model).modules():
        if isinstance(mod, FusedMoE):
            found.add(MoeShape(mod.num_experts + mod.num_shared, mod.num_shared, mod.top_k + mod.num_shared,
                               mod.hidden_size,
                               mod.intermediate_size_per_partition, mod.activation, mod.gated))
    return sorted(found, key=lambda s: (s.hidden, s.inter))


def gemma_fused_gemv_shapes(model: str) -> list[tuple[str, int, int]]:
    """(kind, N, K) of the gemma plugin's fused decode GEMVs (``armillary_gemma.ops.gemv``): each dense MLP's
    down projection with the GeGLU inside, and the tied head with the soft-cap inside (when the model caps)."""
    if model not in ("gemma4", "gemma3"):
        return []
    from armillary_gemma.layers import GemmaMLP

    net = meta_model(model)
    found = {("geglu", *mod.down_proj.weight.shape) for mod in net.modules() if isinstance(mod, GemmaMLP)}
    if net.args.final_softcap:
        found.add(("softcap", *_head_through_ops(model, net)))
    return sorted(found)


def table_decisions(model: str, rows: tuple[int, ...] = (1, 2, 4, 8)) -> dict:
    """What the "auto" backend picks on an sm_90 GPU for ``model``'s decode calls, from the shipped tables
    (the caller makes ``tuning.device_target`` answer "sm_90" off a GPU): {"linear": {(N, K, M): skinny
    GEMM?}, "heads": the head shapes, "gemv": {T: GEMV MoE path?}, "keys": the plugin table's skinny keys}."""
    from armillary.kernels import tuning
    from armillary.kernels.triton import impls, moe, skinny_gemm

    cuda = torch.device("cuda", 0)
    package = PACKAGES[model]
    shapes = linear_shapes(model)
    with tuning.overlay(package):
        linear = {(n, k, m): impls.supports_linear(cuda, torch.bfloat16, tuned_only=True, rows=m, n=n, k=k)
                  for (n, k) in shapes for m in rows}
        gemv = {t: t <= moe.gemv_config(t, cuda)["max_tokens"] for t in range(1, max(rows) + 1)} \
            if moe_shapes(model) else {}
    keys = {k for k in tuning.load_table(package, "sm_90").get(skinny_gemm.KERNEL, {}) if k.startswith("n")}
    heads = {nk for nk, names in shapes.items() if names == ["lm_head"]}
    return {"linear": linear, "heads": heads, "gemv": gemv, "keys": keys}


if __name__ == "__main__":
    for name in sys.argv[1:] or MODELS:
        print(name, PACKAGES[name])
        for (n, k), layers in linear_shapes(name).items():
            print(f"  linear n{n}_k{k}: {', '.join(layers)}")
        for s in moe_shapes(name):
            print(f"  moe {s}")
        for kind, n, k in gemma_fused_gemv_shapes(name):
            print(f"  gemma_gemv {kind}_n{n}_k{k}")
