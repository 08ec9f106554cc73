"""Tiny random Llamas written as GGUF files the way llama.cpp's converter writes them, read back by
armillary: exact weights (Q/K row order undone), every supported quant type against transformers'
own GGUF loader, and Llama 3.1 RoPE carried as ``rope_freqs.weight``."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from armillary import LLM
from armillary_llama.gguf_source import GGUFSource


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (7, 23)]


def test_f32_gguf_gives_back_the_checkpoint_exactly(tmp_path, tiny_llama, gguf_writer, llama_registry, greedy_matches):
    """Names, biases and the Q/K row order survive the round trip bit for bit, and the model runs as the original."""
    _, hf_model = tiny_llama(attention_bias=True, mlp_bias=True)
    path = gguf_writer(hf_model, tmp_path / "tiny-f32.gguf", Q.F32)
    source = GGUFSource(str(path))
    expected = {k: v for k, v in hf_model.state_dict().items() if not k.endswith("inv_freq")}
    got = dict(source.iter_weights(progress=False))
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    config = source.hf_config()
    assert (config.num_key_value_heads, config.head_dim, config.tie_word_embeddings, config.attention_bias) == (2, 16, False, True)

    llm = LLM(model=str(path), registry=llama_registry, dtype="float32", max_num_seqs=2, cpu_kv_cache_space_gb=0.05)
    assert llm.get_tokenizer() is None  # this file carries no vocabulary: prompts are token ids
    greedy_matches(llm, hf_model, _prompts(hf_model.config.vocab_size), new_tokens=16, atol=1e-4)


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0], ids=lambda q: q.name)
def test_quantized_gguf_matches_transformers_gguf_loader(qtype, tmp_path, tiny_llama, gguf_writer, hf_from_gguf,
                                                         llama_registry, greedy_matches):
    _, hf_model = tiny_llama(seed=3)
    path = gguf_writer(hf_model, tmp_path / f"tiny-{qtype.name}.gguf", qtype)
    reference = hf_from_gguf(path)
    llm = LLM(model=str(path), registry=llama_registry, dtype="float32", max_num_seqs=2, cpu_kv_cache_space_gb=0.05)
    greedy_matches(llm, reference, _prompts(hf_model.config.vocab_size), new_tokens=16, atol=1e-4)


def test_k_quants_dequantize_as_transformers_does(tmp_path, tiny_llama, gguf_writer, hf_from_gguf):
    """gguf-py cannot quantize K types, so the weights are random K blocks (bytes < 64 keep every f16 scale finite)."""
    _, hf_model = tiny_llama(hidden_size=256, intermediate_size=256, num_hidden_layers=1, vocab_size=64)
    gen = np.random.default_rng(0)
    k_types = {"blk.0.attn_q.weight": Q.Q4_K, "blk.0.attn_k.weight": Q.Q5_K, "blk.0.attn_v.weight": Q.Q6_K,
               "blk.0.ffn_gate.weight": Q.Q2_K, "blk.0.ffn_up.weight": Q.Q3_K}
    shapes = {"blk.0.attn_q.weight": 256, "blk.0.attn_k.weight": 128, "blk.0.attn_v.weight": 128,
              "blk.0.ffn_gate.weight": 256, "blk.0.ffn_up.weight": 256}
    from gguf.constants import GGML_QUANT_SIZES

    raw = {}
    for name, kind in k_types.items():
        block, size = GGML_QUANT_SIZES[kind]
        raw[name] = gen.integers(0, 64, size=(shapes[name], 256 // block * size), dtype=np.uint8)
    path = gguf_writer(hf_model, tmp_path / "tiny-kquants.gguf", Q.Q8_0, types=k_types, raw=raw)
    ours = dict(GGUFSource(str(path)).iter_weights(progress=False))
    theirs = hf_from_gguf(path).state_dict()
    assert sorted(ours) == sorted(k for k in theirs if not k.endswith("inv_freq"))
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name].float()), name


def test_llama3_rope_from_rope_freqs_tensor(tmp_path, tiny_llama, gguf_writer, llama_registry, greedy_matches):
    """llama.cpp stores Llama 3.1 RoPE scaling as per-frequency divisors; the result must equal transformers'
    llama3 RoPE on the original checkpoint."""
    rope = {"rope_type": "llama3", "rope_theta": 5000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    _, hf_model = tiny_llama(rope_parameters=rope, seed=4)
    head_dim = hf_model.config.head_dim
    base = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    factors = (base / hf_model.model.rotary_emb.inv_freq).numpy()
    assert factors.max() > 2.0  # the scaling really changes some frequencies
    path = gguf_writer(hf_model, tmp_path / "tiny-llama3.gguf", Q.F32, rope_freqs=factors)
    assert GGUFSource(str(path)).hf_config().rope_parameters.rope_type == "freq_factors"
    llm = LLM(model=str(path), registry=llama_registry, dtype="float32", max_num_seqs=2, cpu_kv_cache_space_gb=0.05)
    greedy_matches(llm, hf_model, _prompts(hf_model.config.vocab_size), new_tokens=16, atol=1e-4)
