"""NVFP4 checkpoints as published (ModelOpt ``hf_quant_config.json`` / ``quantization_config``, compressed-tensors ``nvfp4-pack-quantized``, ModelOpt ``MIXED_PRECISION`` of FP8 and NVFP4) and ``--quantization nvfp4`` of tiny Qwen3.5 MoE, Qwen3-Next and Llama models, each against the same model with the dequantized weights: greedy identical for 16 tokens, logits close; named errors for missing or misshapen scales; the weight bytes of the NVFP4 layers."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import armillary_llama.hooks as llama_hooks
from armillary.errors import WeightLoadError
from armillary.llm import LLM
from armillary.registry import PluginRegistry
from armillary.sampling_params import SamplingParams
from plugins.qwen_gdn_moe.tests.harness import qwen_registry
from plugins.qwen_gdn_moe.tests.hf_models import CASES_BY_NAME, build_hf_model
from tests.quantization import nvfp4_writer as nv

PROMPTS = [[5, 17, 42, 7, 99, 3], [250, 1, 1, 80]]
QWEN_LM = "model.language_model.layers"
# as ModelOpt writes them: wildcards over checkpoint module paths
MODELOPT_EXCLUDE = ["lm_head", "*mlp.gate", "*shared_expert_gate", f"{QWEN_LM}.3.self_attn*"]
CT_IGNORE = ["lm_head", r"re:.*mlp\.gate$", r"re:.*shared_expert_gate$", f"{QWEN_LM}.3.self_attn"]


def qwen_quantized(name: str) -> bool:
    """Every projection and expert weight but the vision tower's and layer 3's attention (left in fp32)."""
    return (name.endswith(".weight") and "_proj" in name and "visual" not in name
            and f"{QWEN_LM}.3.self_attn" not in name)


def llama_quantized(name: str) -> bool:
    return name.endswith("_proj.weight")


def llama_registry() -> PluginRegistry:
    registry = PluginRegistry()
    registry.register(llama_hooks, "llama", distribution="armillary-llama")
    return registry


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> tuple[dict, dict]:
    d = tmp_path_factory.mktemp("nvfp4_qwen_src")
    build_hf_model(CASES_BY_NAME["moe35_cg"]).save_pretrained(d)
    return load_file(str(d / "model.safetensors")), json.loads((d / "config.json").read_text())


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> tuple[dict, dict]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.08)
    d = tmp_path_factory.mktemp("nvfp4_llama_src")
    LlamaForCausalLM(config).eval().save_pretrained(d)
    return load_file(str(d / "model.safetensors")), json.loads((d / "config.json").read_text())


def _generate(model_dir: Path, registry: PluginRegistry, dtype: str = "float32", **kw):
    llm = LLM(str(model_dir), registry=registry, dtype=dtype, max_model_len=128, device="cpu", **kw)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0, logprobs=5, ignore_eos=True))
    tokens = [o.outputs[0].token_ids for o in outs]
    lps = [torch.tensor([[lp for _, lp in step.top] for step in o.outputs[0].logprobs]) for o in outs]  # top-5
    return llm, tokens, lps


def _assert_same(got, want) -> None:
    (_, got_tokens, got_lp), (_, want_tokens, want_lp) = got, want
    assert got_tokens == want_tokens and all(len(t) == 16 for t in got_tokens)
    for g, w in zip(got_lp, want_lp):
        assert torch.allclose(g, w, atol=1e-4, rtol=1e-4)


def _pair(root: Path, src: tuple[dict, dict], fmt: str, quantized, exclude: list[str]) -> tuple[Path, Path]:
    """(the checkpoint as published in ``fmt``, the model with its dequantized weights)."""
    tensors, config = src
    if fmt == "modelopt":  # the older export: hf_quant_config.json beside a config.json without quantization
        out, deq = nv.modelopt_nvfp4(tensors, quantized)
        for name in [n for n in out if n.endswith("self_attn.k_proj.weight")]:  # FP8 KV cache scales, as exported
            layer = int(name.split(".layers.")[1].split(".")[0])
            out[name.replace("weight", "k_scale")] = torch.tensor(0.05 + layer / 100)
            out[name.replace("k_proj.weight", "v_proj.v_scale")] = torch.tensor(0.03)
        extra = {"hf_quant_config.json": {"producer": {"name": "modelopt", "version": "0.37.0"},
                                          "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8",
                                                           "group_size": 16, "exclude_modules": exclude}}}
        qdir = nv.write(root / "modelopt", out, config, extra)
    elif fmt == "modelopt_config":  # the newer export: quantization_config in config.json
        out, deq = nv.modelopt_nvfp4(tensors, quantized)
        q = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "ignore": exclude}
        qdir = nv.write(root / "modelopt_config", out, {**config, "quantization_config": q})
    else:
        out, deq = nv.compressed_tensors_nvfp4(tensors, quantized)
        scheme = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True,
                  "dynamic": False}
        q = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "ignore": exclude,
             "quantization_status": "compressed",
             "config_groups": {"group_0": {"targets": ["Linear"], "weights": scheme,
                                           "input_activations": {**scheme, "dynamic": "local"}}}}
        qdir = nv.write(root / "ct", out, {**config, "quantization_config": q})
    return qdir, nv.write(root / "dequantized", deq, config)


@pytest.mark.parametrize("fmt", ["modelopt", "compressed_tensors"])
def test_qwen_moe_nvfp4_checkpoint_matches_dequantized_model(qwen, tmp_path, fmt):
    qdir, ddir = _pair(tmp_path, qwen, fmt, qwen_quantized, MODELOPT_EXCLUDE if fmt == "modelopt" else CT_IGNORE)
    got, want = _generate(qdir, qwen_registry()), _generate(ddir, qwen_registry())
    _assert_same(got, want)
    layers = got[0].engine.model.model.layers
    assert type(layers[0].mlp.experts.quant_method).__name__ == "Nvfp4MoEMethod"
    assert layers[0].mlp.experts.gate_up_proj.dtype == torch.uint8  # shared expert fused in as expert E
    assert layers[0].linear_attn.in_proj.weight.dtype == torch.uint8
    assert layers[1].self_attn.qkv_proj.weight.dtype == torch.uint8
    assert layers[3].self_attn.qkv_proj.weight.dtype == torch.float32  # excluded: fp32 as stored
    assert layers[0].mlp.gate.weight.dtype == torch.float32
    rows = layers[0].linear_attn.in_proj.fp4_global_scale
    assert len(set(rows.tolist())) == 4  # in_proj_qkv, _z, _b, _a: each checkpoint tensor's own global scale
    if fmt == "modelopt":
        kv = got[0].engine.model.checkpoint_kv_scales
        assert kv == {1: {"k": pytest.approx(0.06), "v": pytest.approx(0.03)},
                      3: {"k": pytest.approx(0.08), "v": pytest.approx(0.03)}}


@pytest.mark.parametrize("fmt", ["modelopt_config", "compressed_tensors"])
def test_llama_nvfp4_checkpoint_matches_dequantized_model_in_under_30_percent(llama, tmp_path, fmt):
    qdir, ddir = _pair(tmp_path, llama, fmt, llama_quantized, ["lm_head"])
    got, want = _generate(qdir, llama_registry()), _generate(ddir, llama_registry())
    _assert_same(got, want)
    qbytes = _layer_bytes(LLM(str(qdir), registry=llama_registry(), dtype="bfloat16", max_model_len=64, device="cpu"))
    dbytes = _layer_bytes(LLM(str(ddir), registry=llama_registry(), dtype="bfloat16", max_model_len=64, device="cpu"))
    # 0.5 byte per weight + 1/16 (e4m3 group scales) + 4 / K (fp32 global scale per row): 28.9% at K = 256
    assert qbytes / dbytes <= 0.30, qbytes / dbytes


def _layer_bytes(llm: LLM) -> int:
    """Parameter bytes of the decoder layers (embedding and head stay bf16 in NVFP4 checkpoints too)."""
    return sum(p.numel() * p.element_size() for p in llm.engine.model.model.layers.parameters())


def test_modelopt_mixed_precision_checkpoint_loads_and_matches(qwen, tmp_path):
    tensors, config = qwen
    layers, out, deq = {}, {}, {}
    for name, t in tensors.items():
        if not qwen_quantized(name):
            out[name] = deq[name] = t
            continue
        module = name.removesuffix(".weight")
        if ".self_attn." in name or f"{QWEN_LM}.2.mlp." in name:  # attention, layer 2's experts: FP8; the rest NVFP4
            nv.modelopt_fp8(name, t, out, deq)
            layers[module] = {"quant_algo": "FP8"}
        else:
            part, part_deq = nv.modelopt_nvfp4({name: t}, lambda n: True)
            out.update(part)
            deq.update(part_deq)
            layers[module] = {"quant_algo": "NVFP4", "group_size": 16}
    q = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "quantized_layers": layers,
         "ignore": ["lm_head", "*mlp.gate", "*shared_expert_gate"]}
    qdir = nv.write(tmp_path / "mixed", out, {**config, "quantization_config": q})
    ddir = nv.write(tmp_path / "dequantized", deq, config)
    got, want = _generate(qdir, qwen_registry()), _generate(ddir, qwen_registry())
    _assert_same(got, want)
    model_layers = got[0].engine.model.model.layers
    methods = {i: type(model_layers[i].self_attn.qkv_proj.quant_method).__name__ for i in (1, 3)}
    assert methods == {1: "Fp8PerTensorLinearMethod", 3: "UnquantizedLinearMethod"}  # layer 3 is not listed
    assert model_layers[1].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert type(model_layers[0].linear_attn.in_proj.quant_method).__name__ == "Nvfp4LinearMethod"
    experts = {i: type(model_layers[i].mlp.experts.quant_method).__name__ for i in (0, 2)}
    assert experts == {0: "Nvfp4MoEMethod", 2: "Fp8PerTensorMoEMethod"}


def test_missing_and_misshapen_scales_are_named(qwen, tmp_path):
    qdir, _ = _pair(tmp_path, qwen, "compressed_tensors", qwen_quantized, CT_IGNORE)
    tensors = load_file(str(qdir / "model.safetensors"))
    config = json.loads((qdir / "config.json").read_text())
    attn, expert = f"{QWEN_LM}.1.self_attn", f"{QWEN_LM}.2.mlp.experts.5"
    cases = {
        "missing_global": ({f"{attn}.k_proj.weight_global_scale": None}, "qkv_proj.weight_global_scale"),
        "missing_group": ({f"{expert}.up_proj.weight_scale": None}, "experts.gate_up_proj_weight_scale"),
        "short_group": ({f"{attn}.o_proj.weight_scale": tensors[f"{attn}.o_proj.weight_scale"][:, :3]},
                        "o_proj.weight_scale"),
        "fp32_group": ({f"{attn}.q_proj.weight_scale": tensors[f"{attn}.q_proj.weight_scale"].float()},
                       "qkv_proj.weight_scale"),
        "unpacked": ({f"{expert}.down_proj.weight_packed": torch.zeros(64, 32)}, "down_proj_weight_packed"),
    }
    for case, (change, named) in cases.items():
        broken = {k: v for k, v in {**tensors, **change}.items() if v is not None}
        d = nv.write(tmp_path / case, broken, config)
        with pytest.raises(WeightLoadError, match=named.replace(".", r"\.")):
            _generate(d, qwen_registry())


def test_online_nvfp4_quantizes_each_checkpoint_tensor_as_modelopt_would(qwen, llama, tmp_path):
    """``--quantization nvfp4`` on bf16 checkpoints: each stacked slot gets its own global scale, so the result is
    the ModelOpt export of the checkpoint's tensors (Qwen's in_proj_qkv is three slots: quantized per slot here)."""
    tensors, config = llama
    src = nv.write(tmp_path / "llama_bf16", tensors, config)
    ddir = nv.write(tmp_path / "llama_deq", nv.modelopt_nvfp4(tensors, llama_quantized)[1], config)
    _assert_same(_generate(src, llama_registry(), quantization="nvfp4"), _generate(ddir, llama_registry()))
    tensors, config = qwen
    split = {}
    for name, t in tensors.items():
        if name.endswith("in_proj_qkv.weight"):  # rows [q | k | v] of 32 each in this tiny model
            for i, piece in enumerate(t.split(32)):
                split[f"{name}#{i}"] = piece
        else:
            split[name] = t
    online = lambda n: qwen_quantized(n.split("#")[0]) or f"{QWEN_LM}.3.self_attn" in n and n.endswith("_proj.weight")
    deq = nv.modelopt_nvfp4(split, online)[1]
    for name in [n for n in deq if n.endswith("#0")]:
        base = name[:-2]
        deq[base] = torch.cat([deq.pop(f"{base}#{i}") for i in range(3)])
    src = nv.write(tmp_path / "qwen_bf16", tensors, config)
    ddir = nv.write(tmp_path / "qwen_deq", deq, config)
    got = _generate(src, qwen_registry(), quantization="nvfp4")
    _assert_same(got, _generate(ddir, qwen_registry()))
    layers = got[0].engine.model.model.layers
    assert layers[3].self_attn.qkv_proj.weight.dtype == torch.uint8  # online: every layer but routers and head
    assert layers[0].mlp.gate.weight.dtype == torch.float32


def test_qwen3_next_fused_gdn_projections_take_their_scales_into_every_slot(tmp_path):
    """Qwen3-Next's in_proj_qkvz / in_proj_ba (rows grouped per key head) carry one global scale each: it must
    reach all four / two slots of in_proj, the group scales cut like the weight rows."""
    src = tmp_path / "src"
    build_hf_model(CASES_BY_NAME["next_full_last"]).save_pretrained(src)
    tensors, config = load_file(str(src / "model.safetensors")), json.loads((src / "config.json").read_text())
    qdir, ddir = _pair(tmp_path, (tensors, config), "modelopt", qwen_quantized, ["lm_head", "*mlp.gate",
                                                                                 "*shared_expert_gate"])
    got = _generate(qdir, qwen_registry())
    _assert_same(got, _generate(ddir, qwen_registry()))
    gdn = got[0].engine.model.model.layers[0].linear_attn.in_proj
    assert gdn.weight.dtype == torch.uint8 and len(set(gdn.fp4_global_scale.tolist())) == 2


def test_compressed_tensors_mixed_fp8_attention_and_nvfp4_rest(qwen, tmp_path):
    """format mixed-precision: a per-channel FP8 group for attention (first match wins), NVFP4 for the rest."""
    tensors, config = qwen
    out, deq = nv.compressed_tensors_nvfp4({n: t for n, t in tensors.items() if ".self_attn." not in n},
                                           qwen_quantized)
    for name, t in tensors.items():
        if ".self_attn." in name and qwen_quantized(name):
            scale = (t.abs().amax(1, keepdim=True) / 448).clamp(min=1e-12)  # [N, 1]
            q = (t / scale).to(torch.float8_e4m3fn)
            out[name], out[name.replace("weight", "weight_scale")], deq[name] = q, scale, q.float() * scale
        elif ".self_attn." in name:
            out[name] = deq[name] = t
    fp8 = {"format": "float-quantized", "targets": [r"re:.*self_attn.*"],
           "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
           "input_activations": {"num_bits": 8, "type": "float", "dynamic": True, "strategy": "token"}}
    scheme = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}
    fp4 = {"format": "nvfp4-pack-quantized", "targets": ["Linear"], "weights": scheme,
           "input_activations": {**scheme, "dynamic": "local"}}  # W4A4: the writer stores input_global_scale
    q = {"quant_method": "compressed-tensors", "format": "mixed-precision", "ignore": CT_IGNORE,
         "config_groups": {"fp8": fp8, "fp4": fp4}}
    qdir = nv.write(tmp_path / "ct_mixed", out, {**config, "quantization_config": q})
    got = _generate(qdir, qwen_registry())
    _assert_same(got, _generate(nv.write(tmp_path / "deq", deq, config), qwen_registry()))
    layers = got[0].engine.model.model.layers
    assert layers[1].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert layers[0].linear_attn.in_proj.weight.dtype == torch.uint8 and "weight_packed" not in dict(
        layers[0].linear_attn.in_proj.named_parameters())  # renamed to weight after loading


def test_triton_fast_path_runs_the_nvfp4_checkpoint(tmp_path):
    """A tiny Llama's NVFP4 layers through the Triton kernels (the interpreter on the CPU) against the references
    (the MoE kernel's own checks are the kernel tests'; a whole MoE model under the interpreter takes minutes)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         initializer_range=0.08)
    src = tmp_path / "src"
    LlamaForCausalLM(config).eval().save_pretrained(src)
    tensors, cfg = load_file(str(src / "model.safetensors")), json.loads((src / "config.json").read_text())
    qdir, _ = _pair(tmp_path, (tensors, cfg), "modelopt_config", llama_quantized, ["lm_head"])
    prompts = [[5, 17, 42, 7, 99], [100, 1]]  # prefill and decode steps of a few rows: the small-M paths

    def run(backend: str):
        llm = LLM(str(qdir), registry=llama_registry(), dtype="float32", max_model_len=64, device="cpu",
                  kernel_backend=backend)
        assert llm.engine.kernels.chosen("fp4_linear") == ("torch_fp4_linear" if backend == "reference"
                                                            else "triton_fp4_linear")
        outs = llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0, logprobs=5))
        return [o.outputs[0].token_ids for o in outs], [[s.logprob for s in o.outputs[0].logprobs] for o in outs]

    fast_tokens, fast_lp = run("triton")
    ref_tokens, ref_lp = run("reference")
    assert fast_tokens == ref_tokens
    assert max(abs(a - b) for f, r in zip(fast_lp, ref_lp) for a, b in zip(f, r)) < 1e-3
