"""Forced tool calls on a model without a tool parser, through ``armillary serve`` and the official clients.

A tiny random ``LlamaForCausalLM`` (the llama plugin names no tool parser) with a chat template
that renders tools as JSON: ``tool_choice`` ``required`` / a named function (OpenAI) and ``any`` /
``tool`` (Anthropic) are served through vLLM's JSON grammar, streamed or not, and every call's
arguments validate against its schema. ``auto`` without a parser is a 400 that says how to start
the server with one.
"""
from __future__ import annotations

import asyncio
import json
import re
import signal
from pathlib import Path

import anthropic
import httpx
import jsonschema
import openai
import pytest
import torch

from tests.fixtures.tiny_tokenizer import make_qwen_tokenizer
from tests.fixtures.weather_tools import ANTHROPIC_TOOLS, SCHEMAS, TOOLS
from tests.server.live_server import API_KEY, MODEL_NAME, start_server
from tests.server.test_server_live import reassemble_chat_stream

VOCAB = 300
# Llama 3.1's JSON tool template, in the tiny tokenizer's chat tokens
JSON_TOOLS_TEMPLATE = r"""{%- if tools -%}
<|im_start|>system
To call a function, reply with JSON {"name": function name, "parameters": its arguments}. The functions:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% endif -%}
{%- for message in messages -%}
<|im_start|>{{ message.role }}
{% if message.tool_calls -%}
{%- for call in message.tool_calls %}{{ {"name": call.function.name, "parameters": call.function.arguments} | tojson }}
{% endfor -%}
{%- else %}{{ message.content }}{% endif %}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}
"""
USER = [{"role": "user", "content": "What is the weather like in Paris today?"}]
N = 12
SAMPLED = {"temperature": 1.0, "seed": 3}


def save_tiny_llama(path: Path) -> None:
    """transformers' random ``LlamaForCausalLM``, the tiny tokenizer, and a JSON tool template."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    LlamaForCausalLM(config).eval().save_pretrained(path)
    make_qwen_tokenizer(path, vocab_size=VOCAB)  # after the model: its generation_config.json names the eos ids
    (path / "chat_template.jinja").write_text(JSON_TOOLS_TEMPLATE)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny_llama_no_parser")
    save_tiny_llama(path)
    return path


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    live = start_server(checkpoint, tmp_path_factory.mktemp("llama_server") / "serve.log", "--api-key", API_KEY,
                        "--max-model-len", "2048")
    assert "tool-call parser none" in live.log()
    yield live
    assert live.stop(signal.SIGINT) == 0, live.log()


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


def chat(oai: openai.OpenAI, stream: bool, **kw) -> list[dict]:
    """N choices as {content, calls: [{name, arguments}], finish}, from a streamed or a whole reply."""
    args = {"model": MODEL_NAME, "messages": USER, "n": N, "tools": TOOLS, **SAMPLED, **kw}
    if stream:
        choices = reassemble_chat_stream(oai.chat.completions.create(stream=True, **args))["choices"]
        return [{"content": c["content"], "finish": c["finish"], "calls": [c["calls"][i] for i in sorted(c["calls"])]}
                for _, c in sorted(choices.items())]
    return [{"content": c.message.content or "", "finish": c.finish_reason,
             "calls": [{"id": t.id, "name": t.function.name, "arguments": t.function.arguments}
                       for t in c.message.tool_calls or []]}
            for c in oai.chat.completions.create(**args).choices]


def check_calls(choices: list[dict], allowed: tuple[str, ...], parallel: bool) -> None:
    assert len(choices) == N
    counts = []
    for choice in choices:
        assert choice["finish"] == "tool_calls", choice
        assert choice["content"].strip() == "" and choice["calls"], choice
        counts.append(len(choice["calls"]))
        for call in choice["calls"]:
            assert call["name"] in allowed and call["id"].startswith("call_")
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    assert max(counts) > 1 if parallel else set(counts) == {1}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_openai_required(oai, stream):
    # no max_tokens: the rest of the context, which the grammar's array never needs
    check_calls(chat(oai, stream, tool_choice="required"), ("get_weather", "convert"), True)


def test_openai_required_single_and_named(oai):
    check_calls(chat(oai, False, tool_choice="required", parallel_tool_calls=False, max_tokens=200),
                ("get_weather", "convert"), False)
    named = {"type": "function", "function": {"name": "convert"}}
    check_calls(chat(oai, True, tool_choice=named, max_tokens=200), ("convert",), False)


def test_tool_results_go_back_into_the_conversation(oai):
    first = chat(oai, False, n=1, tool_choice="required", parallel_tool_calls=False, max_tokens=200)[0]["calls"][0]
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": first["id"], "type": "function", "function": {"name": first["name"],
                                                                 "arguments": first["arguments"]}}]},
        {"role": "tool", "tool_call_id": first["id"], "content": "sunny, 21 C"}]
    reply = oai.chat.completions.create(model=MODEL_NAME, messages=history, tools=TOOLS, tool_choice="none",
                                        max_tokens=5, **SAMPLED)
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason in ("stop", "length")


async def _anthropic(url: str, stream: bool, **kw) -> list[anthropic.types.Message]:
    async with anthropic.AsyncAnthropic(base_url=url, api_key=API_KEY, max_retries=0, timeout=300) as client:
        async def one() -> anthropic.types.Message:
            args = {"model": MODEL_NAME, "messages": USER, "tools": ANTHROPIC_TOOLS, **kw}
            if not stream:
                return await client.messages.create(**args)
            async with client.messages.stream(**args) as events:
                return await events.get_final_message()
        return await asyncio.gather(*(one() for _ in range(N)))


@pytest.mark.parametrize("choice,stream", [
    ({"type": "any"}, False), ({"type": "any"}, True), ({"type": "tool", "name": "get_weather"}, True)],
    ids=["any", "any-stream", "tool-stream"])
def test_anthropic_forced(server, choice, stream):
    messages = asyncio.run(_anthropic(server.url, stream, tool_choice=choice, max_tokens=1000))
    counts = []
    for message in messages:
        assert message.stop_reason == "tool_use", message
        assert message.content and all(block.type == "tool_use" for block in message.content)
        counts.append(len(message.content))
        for block in message.content:
            assert choice["type"] == "any" or block.name == choice["name"]
            jsonschema.validate(block.input, SCHEMAS[block.name])
    assert max(counts) > 1 if choice["type"] == "any" else set(counts) == {1}


def test_auto_without_a_parser_says_how_to_start_with_one(server, oai):
    for tool_choice in ("auto", openai.NOT_GIVEN):
        with pytest.raises(openai.BadRequestError) as error:
            oai.chat.completions.create(model=MODEL_NAME, messages=USER, tools=TOOLS, tool_choice=tool_choice,
                                        max_tokens=5)
        message = error.value.body["message"]
        assert "--enable-auto-tool-choice --tool-call-parser NAME" in message
        assert re.search(r"registered tool parsers: [^\n]*hermes, [^\n]*llama3_json", message), message
        assert error.value.body["param"] == "tool_choice"
    claude = anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="--enable-auto-tool-choice"):
        claude.messages.create(model=MODEL_NAME, messages=USER, tools=ANTHROPIC_TOOLS, max_tokens=5)
    # tools the reply may not call are only text in the prompt: nothing to parse, no parser needed
    none = oai.chat.completions.create(model=MODEL_NAME, messages=USER, tools=TOOLS, tool_choice="none", max_tokens=3)
    assert none.choices[0].message.tool_calls is None
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert "armillary_num_requests_running 0.0" in metrics


def test_enable_auto_tool_choice_needs_a_parser_at_start_up(checkpoint, tmp_path):
    """vLLM's rule: the flag without a tool-call parser (none named, none by default) stops the start-up."""
    with pytest.raises(RuntimeError, match="--enable-auto-tool-choice needs a tool-call parser") as error:
        start_server(checkpoint, tmp_path / "serve.log", "--enable-auto-tool-choice", "--max-model-len", "256")
    assert re.search(r"registered tool parsers: [^\n]*hermes, [^\n]*llama3_json", str(error.value)), error.value
    assert "Traceback" not in str(error.value)


def test_the_hermes_parser_serves_forced_and_auto_calls(checkpoint, tmp_path):
    """With ``--tool-call-parser hermes`` forced calls follow hermes' own grammar and come back through its parser."""
    live = start_server(checkpoint, tmp_path / "serve.log", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                        "--max-model-len", "2048")
    try:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=300)
        check_calls(chat(client, True, tool_choice="required", parallel_tool_calls=False, max_tokens=200),
                    ("get_weather", "convert"), False)
        auto = client.chat.completions.create(model=MODEL_NAME, messages=USER, tools=TOOLS, max_tokens=8, **SAMPLED)
        assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")
    finally:
        assert live.stop(signal.SIGINT) == 0, live.log()
