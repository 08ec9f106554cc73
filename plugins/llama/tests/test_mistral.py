"""``MistralForCausalLM`` (llama + ``sliding_window``) through armillary's offline API against transformers'
Mistral, with a window shorter than the prompt: greedy tokens, log-probabilities, the cache layout, the
blocks a sequence holds; and a llama config carrying a window (served windowed, with one warning)."""
from __future__ import annotations

import json
import logging

import pytest
import torch

from armillary import LLM, SamplingParams
from armillary.cache_spec import FullAttention, SlidingWindow
from armillary.hf_config import HFConfig
from armillary.memory.groups import SlidingWindowGroup
from armillary.sequence import Sequence
from armillary_llama.model import LlamaForCausalLM, MistralForCausalLM

WINDOW, PROMPT_LEN, NEW, BLOCK = 24, 40, 32, 8
TINY = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, sliding_window=WINDOW)


@pytest.fixture
def tiny_mistral(tmp_path):
    from transformers import MistralConfig
    from transformers import MistralForCausalLM as HFMistral

    torch.manual_seed(0)
    model = HFMistral(MistralConfig(**TINY)).eval()
    with torch.no_grad():  # random init has tiny norms: spread them so every weight matters
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    model.save_pretrained(tmp_path / "mistral")
    return tmp_path / "mistral", model


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, TINY["vocab_size"], (n,), generator=gen).tolist() for n in (PROMPT_LEN, PROMPT_LEN + 3)]


def blocks_held(engine, seq: Sequence) -> int:
    """KV blocks ``seq`` holds in its sliding-window cache group (stale entries point at the null block)."""
    (group,) = [g for g in engine.cache.paged if isinstance(g, SlidingWindowGroup)]
    return sum(block != group.null_block for block in group.table(seq))


# 2048: each prompt in one windowed prefill; 16: chunks that start after cached context, mixed with decodes
@pytest.mark.parametrize("budget", [2048, 16])
def test_greedy_and_logprobs_match_transformers(budget, tiny_mistral, llama_registry, greedy_matches):
    directory, hf_model = tiny_mistral
    assert hf_model.config._attn_implementation in ("sdpa", "eager")
    llm = LLM(model=str(directory), registry=llama_registry, dtype="float32", block_size=BLOCK, max_num_seqs=4,
              max_num_batched_tokens=budget, max_model_len=128, cpu_kv_cache_space_gb=0.05)
    assert llm.engine.arch.name == "mistral"
    greedy_matches(llm, hf_model, _prompts(), new_tokens=NEW, atol=1e-4)


def test_window_changes_the_output(tiny_mistral, llama_registry):
    """The same weights with full attention give other tokens: the window is really applied."""
    directory, hf_model = tiny_mistral
    llm = LLM(model=str(directory), registry=llama_registry, dtype="float32", block_size=BLOCK, max_model_len=128,
              cpu_kv_cache_space_gb=0.05)
    prompt = _prompts()[0]
    ours = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=NEW,
                                                                       ignore_eos=True))[0].outputs[0].token_ids
    hf_model.config.sliding_window = None
    with torch.no_grad():
        full = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                 pad_token_id=hf_model.config.eos_token_id)[0, PROMPT_LEN:].tolist()
    assert ours != full


def test_blocks_held_stay_within_the_window(tiny_mistral, llama_registry):
    """Out-of-window blocks go back to the pool as decoding advances, and the tokens stay transformers'."""
    directory, hf_model = tiny_mistral
    llm = LLM(model=str(directory), registry=llama_registry, dtype="float32", block_size=BLOCK, max_model_len=128,
              cpu_kv_cache_space_gb=0.05)
    engine = llm.engine
    engine.add_request("r", _prompts()[0], SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
    held, tokens = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
        held.extend(blocks_held(engine, s) for s in engine.scheduler.running)
    assert len(held) >= NEW - 1 and max(held) <= WINDOW // BLOCK + 2
    assert -(-(PROMPT_LEN + NEW) // BLOCK) > WINDOW // BLOCK + 2  # a full-attention table would exceed the bound
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([_prompts()[0]]), max_new_tokens=NEW, min_new_tokens=NEW,
                                do_sample=False, pad_token_id=hf_model.config.eos_token_id)
    assert tokens == ref[0, PROMPT_LEN:].tolist()


def test_cache_layout_is_a_window_per_layer_or_full_attention():
    base = {"vocab_size": 10, "hidden_size": 32, "intermediate_size": 8, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2}
    windowed = SlidingWindow(kv_heads=2, head_dim=8, window=24)
    assert MistralForCausalLM.cache_layout(HFConfig({**base, "sliding_window": 24})) == [windowed] * 2
    full = [FullAttention(kv_heads=2, head_dim=8)] * 2
    assert MistralForCausalLM.cache_layout(HFConfig({**base, "sliding_window": None})) == full
    assert MistralForCausalLM.cache_layout(HFConfig(base)) == full
    assert MistralForCausalLM.cache_layout(HFConfig({**base, "sliding_window": 24, "use_sliding_window": False})) == full
    mixed = HFConfig({**base, "sliding_window": 24, "layer_types": ["sliding_attention", "full_attention"]})
    assert MistralForCausalLM.cache_layout(mixed) == [windowed, full[0]]
    with pytest.raises(ValueError, match="sliding_window must be a positive int"):
        MistralForCausalLM.cache_layout(HFConfig({**base, "sliding_window": [24, 48]}))


def test_llama_config_with_a_window_is_served_windowed_and_warned(tiny_mistral, llama_registry, greedy_matches,
                                                                  caplog):
    """A Mistral checkpoint relabelled ``LlamaForCausalLM``: windowed as vLLM serves it, one warning naming
    the field (transformers' Llama would ignore it)."""
    directory, hf_model = tiny_mistral
    config = json.loads((directory / "config.json").read_text())
    config.update(architectures=["LlamaForCausalLM"], model_type="llama")
    (directory / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING, logger="armillary_llama"):
        llm = LLM(model=str(directory), registry=llama_registry, dtype="float32", block_size=BLOCK,
                  max_model_len=128, cpu_kv_cache_space_gb=0.05)
    assert llm.engine.arch.name == "llama"
    warned = [r.getMessage() for r in caplog.records if "sliding_window" in r.getMessage()]
    assert len(warned) == 1 and "sliding_window=24" in warned[0] and "LlamaForCausalLM" in warned[0]
    greedy_matches(llm, hf_model, _prompts()[:1], new_tokens=NEW, atol=1e-4)


def test_plain_llama_config_logs_no_window_warning(tiny_llama, caplog):
    directory, _ = tiny_llama()
    with caplog.at_level(logging.WARNING, logger="armillary_llama"):
        LlamaForCausalLM(HFConfig.from_file(directory / "config.json"))
    assert not [r for r in caplog.records if "sliding_window" in r.getMessage()]


def test_a_pool_smaller_than_the_request_serves_it_when_the_window_fits(tiny_mistral, llama_registry):
    """Admission counts what a windowed sequence can hold at once, not its length: 72 tokens in 6 blocks
    of 8 (window 24 + a 16-token chunk + one stale block); a full-attention request that long is refused."""
    from armillary.errors import InvalidRequestError

    directory, hf_model = tiny_mistral
    kw = dict(registry=llama_registry, dtype="float32", block_size=BLOCK, max_model_len=128, num_kv_blocks=6,
              max_num_batched_tokens=16)
    llm = LLM(model=str(directory), **kw)
    prompt = _prompts()[0]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=NEW,
                                                                       ignore_eos=True))[0].outputs[0].token_ids
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                pad_token_id=hf_model.config.eos_token_id)[0, PROMPT_LEN:].tolist()
    assert out == ref and llm.engine.cache.pool.num_used == 0
    config = json.loads((directory / "config.json").read_text())
    config["sliding_window"] = None
    (directory / "config.json").write_text(json.dumps(config))
    full = LLM(model=str(directory), **kw)
    with pytest.raises(InvalidRequestError, match="needs 9 KV blocks"):
        full.engine.add_request("r", prompt, SamplingParams(max_tokens=NEW))
    assert not full.engine.requests and full.engine.cache.pool.num_used == 0
