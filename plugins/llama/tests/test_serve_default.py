"""``armillary serve`` with no arguments serves SmolLM2-135M-Instruct and answers real questions."""
from __future__ import annotations

import time

import openai
import pytest

from tests.server.live_server import start_server


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("default_serve") / "serve.log"
    started = time.monotonic()
    live = start_server(None, log_path, "--max-num-seqs", "4")
    live.startup_s = time.monotonic() - started
    yield live
    assert live.stop() == 0, live.log()


@pytest.fixture()
def client(default_server):
    return openai.OpenAI(base_url=f"{default_server.url}/v1", api_key="unused", timeout=120)


def test_first_log_line_names_the_default_model(default_server):
    first = default_server.log().splitlines()[0]
    assert "default model" in first and "SmolLM2-135M-Instruct" in first


def test_served_under_its_model_name(client):
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]


def test_capital_of_france(client):
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, temperature=0, max_tokens=24,
                                           messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in reply.choices[0].message.content


def test_streamed_answer_equals_whole(client):
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Name three colours."}]
    whole = client.chat.completions.create(model=model, temperature=0, max_tokens=20, messages=messages)
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=model, temperature=0, max_tokens=20, messages=messages, stream=True) if c.choices]
    assert len([p for p in pieces if p]) > 1
    assert "".join(pieces) == whole.choices[0].message.content


def test_multi_turn_uses_the_history(client):
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "My name is Alice."},
                {"role": "assistant", "content": "Nice to meet you, Alice!"},
                {"role": "user", "content": "What is my name?"}]
    reply = client.chat.completions.create(model=model, temperature=0, max_tokens=24, messages=messages)
    assert "Alice" in reply.choices[0].message.content
    alone = client.chat.completions.create(model=model, temperature=0, max_tokens=24, messages=messages[-1:])
    assert "Alice" not in alone.choices[0].message.content
    assert reply.usage.prompt_tokens > alone.usage.prompt_tokens
