"""The seeds' (Atlas's) command line verbatim through ``armillary serve`` and the openai client: every flag acts.

Model and port aside, on a tiny Qwen3.6-shaped checkpoint with an MTP head: thinking off, 204 tokens,
a forced ``calculator`` call and its result fed back, a thinking budget of 16 ending reasoning at 16
tokens, drafts verified and prefixes served from the cache; and with ``--disable-thinking
--max-thinking-budget 8`` added, thinking off by default and reasoning capped at 8 tokens.
"""
from __future__ import annotations

import json
import signal

import anthropic
import openai
import pytest

from plugins.qwen_gdn_moe.tests.hf_models import VOCAB, Case
from plugins.qwen_gdn_moe.tests.mtp_checkpoint import save_with_mtp
from tests.fixtures.tiny_tokenizer import make_qwen_tokenizer
from tests.server.live_server import start_server

L, F = "linear_attention", "full_attention"
# Qwen3.6-35B-A3B's layout in miniature: GDN and gated attention, MoE everywhere, three attention layers so
# that --kv-high-precision-layers auto (first and last) leaves one in fp8
SEEDS_CASE = Case("seeds_qwen36", "moe_causal", dict(
    hidden_size=64, layer_types=[F, L, F, L, F], num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True}))

# Atlas's line: serve Qwen/Qwen3.6-35B-A3B-FP8 --port 8888 --bind 0.0.0.0 --max-seq-len 65536 --kv-cache-dtype fp8
# --kv-high-precision-layers auto --gpu-memory-utilization 0.90 --scheduling-policy slai --enable-prefix-caching
# --speculative --num-drafts 2 --tool-call-parser qwen3_coder   (here: a local model, --port 0, loopback, 4096)
SEEDS_FLAGS = ("--bind", "127.0.0.1", "--max-seq-len", "4096", "--kv-cache-dtype", "fp8",
               "--kv-high-precision-layers", "auto", "--gpu-memory-utilization", "0.90", "--scheduling-policy", "slai",
               "--enable-prefix-caching", "--speculative", "--num-drafts", "2", "--tool-call-parser", "qwen3_coder")
CALCULATOR = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string", "maxLength": 24}},
                   "required": ["expression"]}}}]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def seeds_server(tmp_path_factory):
    path = save_with_mtp(SEEDS_CASE, tmp_path_factory.mktemp("seeds_qwen36"))
    make_qwen_tokenizer(path, vocab_size=VOCAB)
    log_path = tmp_path_factory.mktemp("seeds_logs") / "serve.log"
    live = start_server(path, log_path, *SEEDS_FLAGS)
    yield live
    assert live.stop(signal.SIGTERM) == 0, live.log()


@pytest.fixture(scope="module")
def client(seeds_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{seeds_server.url}/v1", api_key="none", max_retries=0, timeout=300)


def test_starts_with_every_flag_acting(seeds_server):
    log = seeds_server.log()
    assert "tool-call parser qwen3_coder" in log and "reasoning parser qwen3" in log
    assert "listening on http://127.0.0.1:" in log
    assert "fp8 KV cache" in log
    assert "qwen3_5_moe's mode defaults (non_thinking, thinking)" in log


def test_short_answer_with_thinking_off(client):
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi!"}],
                                           max_tokens=6, extra_body=NO_THINK)
    choice = reply.choices[0]
    assert choice.message.content and reply.usage.completion_tokens <= 6
    assert not getattr(choice.message, "reasoning_content", None)


def test_204_token_answer(client):
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Tell me about the weather in Berlin."}],
        max_tokens=204, extra_body={**NO_THINK, "min_tokens": 204})
    assert reply.usage.completion_tokens == 204 and reply.choices[0].finish_reason == "length"
    assert reply.choices[0].message.content


def test_forced_calculator_call_then_the_result_fed_back(client):
    messages = [{"role": "user", "content": "What is 12 * 7? Use the calculator."}]
    call_reply = client.chat.completions.create(
        model="tiny", messages=messages, tools=CALCULATOR, max_tokens=200,
        tool_choice={"type": "function", "function": {"name": "calculator"}},
        extra_body={"chat_template_kwargs": {"thinking_budget": 16}})  # thinking on, ended at 16 tokens
    message = call_reply.choices[0].message
    assert call_reply.choices[0].finish_reason == "tool_calls", message
    (call,) = message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "calculator" and isinstance(args["expression"], str)
    messages += [{"role": "assistant", "content": message.content, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": "84"}]
    answer = client.chat.completions.create(model="tiny", messages=messages, tools=CALCULATOR, tool_choice="none",
                                            max_tokens=24, extra_body={"chat_template_kwargs": {"thinking_budget": 8}})
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


def test_thinking_budget_of_16_ends_reasoning_at_16_tokens(seeds_server, client):
    user = [{"role": "user", "content": "Think about the weather."}]
    reply = client.chat.completions.create(
        model="tiny", messages=user, max_tokens=40, temperature=0, logprobs=True, top_logprobs=0,
        extra_body={"chat_template_kwargs": {"thinking_budget": 16}})
    tokens = [t.token for t in reply.choices[0].logprobs.content]
    assert "</think>" not in tokens[:16] and tokens[16] == "</think>", tokens
    reasoning = reply.choices[0].message.reasoning_content
    assert reasoning
    # Anthropic's thinking.budget_tokens: the same 16 tokens of thinking, then the answer
    claude = anthropic.Anthropic(base_url=seeds_server.url, api_key="none", max_retries=0, timeout=300)
    message = claude.messages.create(model="tiny", messages=user, max_tokens=40, extra_body={"temperature": 0},
                                     thinking={"type": "enabled", "budget_tokens": 16})
    assert [b.type for b in message.content][:2] == ["thinking", "text"]
    assert message.content[0].thinking == reasoning


def test_speculation_and_prefix_cache_acted(seeds_server, client):
    """After the replies above (module order): drafts were verified, and a long prompt sent twice is served from the
    prefix cache the second time (hybrid model: from the recurrent-state snapshot every 256 tokens)."""
    long_prompt = "Tell me about the weather in Berlin, please. " * 40
    for _ in range(2):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": long_prompt}],
                                       max_tokens=4, extra_body=NO_THINK)
    metrics = seeds_server.metrics()
    assert metrics["armillary_spec_decode_num_draft_tokens"] > 0
    assert metrics["armillary_prefix_cache_hit_tokens"] > 0


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory):
    """The same command with Atlas's thinking flags: thinking off by default, at most 8 reasoning tokens."""
    path = save_with_mtp(SEEDS_CASE, tmp_path_factory.mktemp("seeds_thinking"))
    make_qwen_tokenizer(path, vocab_size=VOCAB)
    log_path = tmp_path_factory.mktemp("seeds_thinking_logs") / "serve.log"
    live = start_server(path, log_path, *SEEDS_FLAGS, "--disable-thinking", "--max-thinking-budget", "8")
    yield live
    assert live.stop(signal.SIGTERM) == 0, live.log()


def test_disable_thinking_and_max_thinking_budget_act(thinking_server):
    assert "thinking: off by default, at most 8 reasoning tokens" in thinking_server.log()
    client = openai.OpenAI(base_url=f"{thinking_server.url}/v1", api_key="none", max_retries=0, timeout=300)
    user = [{"role": "user", "content": "Think about the weather."}]

    def reply(**extra):
        return client.chat.completions.create(model="tiny", messages=user, max_tokens=24, temperature=0,
                                              logprobs=True, top_logprobs=0, extra_body=extra).choices[0]

    def tokens(**extra) -> list[str]:
        return [t.token for t in reply(**extra).logprobs.content]

    off = reply()  # thinking off: the template closed an empty block itself, the reply is all content
    assert off.message.content and not getattr(off.message, "reasoning_content", None)
    on = {"enable_thinking": True}
    for asked in ({}, {"thinking_budget": 100}):  # the server's budget, and a request's capped by it
        out = tokens(chat_template_kwargs={**on, **asked})
        assert "</think>" not in out[:8] and out[8] == "</think>", out
    out = tokens(chat_template_kwargs={**on, "thinking_budget": 3})  # a request may ask for less
    assert out[3] == "</think>", out
