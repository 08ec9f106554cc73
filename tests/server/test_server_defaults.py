"""Defaults as OpenAI / vLLM through ``armillary serve``: output length, logprob limits, prompt_logprobs, a free event loop.

One server with a short context (96 tokens, so "the rest of the context" is quick to reach),
``--max-logprobs 25`` (above the old fixed cap of 20) and the default 32 MB body limit.
"""
from __future__ import annotations

import signal
import threading
import time

import anthropic
import httpx
import openai
import pytest

from tests.server.live_server import API_KEY, MODEL_NAME, start_server

CONTEXT = 96
MAX_LOGPROBS = 25
USER = [{"role": "user", "content": "Say something."}]
RUN_ON = {"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}}  # noise never stops early


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("defaults_server") / "serve.log"
    live = start_server(tiny_checkpoint, log_path, "--api-key", API_KEY, "--max-model-len", str(CONTEXT),
                        "--max-logprobs", str(MAX_LOGPROBS))
    yield live
    assert live.stop(signal.SIGINT) == 0, live.log()


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_chat_without_max_tokens_runs_to_the_end_of_the_context(oai):
    for stream in (False, True):
        if stream:
            chunks = list(oai.chat.completions.create(model=MODEL_NAME, messages=USER, stream=True,
                                                      stream_options={"include_usage": True}, extra_body=RUN_ON))
            usage = chunks[-1].usage
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        else:
            reply = oai.chat.completions.create(model=MODEL_NAME, messages=USER, extra_body=RUN_ON)
            usage, finish = reply.usage, [reply.choices[0].finish_reason]
        assert finish == ["length"]
        assert usage.completion_tokens > 16
        assert usage.prompt_tokens + usage.completion_tokens == CONTEXT


def test_an_explicit_max_completion_tokens_still_caps_the_reply(oai):
    reply = oai.chat.completions.create(model=MODEL_NAME, messages=USER, max_completion_tokens=5, extra_body=RUN_ON)
    assert reply.usage.completion_tokens == 5 and reply.choices[0].finish_reason == "length"


def test_legacy_completions_keep_16_tokens(oai):
    reply = oai.completions.create(model=MODEL_NAME, prompt="Once upon a time", extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 16 and reply.choices[0].finish_reason == "length"
    # null asks for the rest of the context, as in vLLM
    rest = oai.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=None,
                                  extra_body={"ignore_eos": True})
    assert rest.usage.prompt_tokens + rest.usage.completion_tokens == CONTEXT


def test_anthropic_still_requires_max_tokens(server):
    """The Messages API has no default length (its SDK will not even send a request without one)."""
    reply = httpx.post(f"{server.url}/v1/messages", json={"model": MODEL_NAME, "messages": USER}, timeout=30,
                       headers={"x-api-key": API_KEY, "anthropic-version": "2023-06-01"})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and "max_tokens" in error["message"]
    claude = anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0)
    assert claude.messages.create(model=MODEL_NAME, messages=USER, max_tokens=3).usage.output_tokens <= 3


def test_max_logprobs_is_the_limit(oai):
    reply = oai.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=2, logprobs=True,
                                        top_logprobs=MAX_LOGPROBS)
    assert [len(t.top_logprobs) for t in reply.choices[0].logprobs.content] == [MAX_LOGPROBS] * 2
    with pytest.raises(openai.BadRequestError, match=f"limit of {MAX_LOGPROBS}") as chat_error:
        oai.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=2, logprobs=True,
                                    top_logprobs=MAX_LOGPROBS + 1)
    assert chat_error.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError, match="--max-logprobs") as completion_error:
        oai.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2, logprobs=MAX_LOGPROBS + 1)
    assert completion_error.value.body["param"] == "logprobs"


def test_prompt_logprobs_is_refused_not_ignored(oai):
    for create, args in ((oai.chat.completions.create, {"messages": USER}), (oai.completions.create, {"prompt": "Hi"})):
        for value in (0, 3):
            with pytest.raises(openai.BadRequestError, match="prompt_logprobs") as error:
                create(model=MODEL_NAME, max_tokens=2, extra_body={"prompt_logprobs": value}, **args)
            assert error.value.body["param"] == "prompt_logprobs" and error.value.body["code"] == "not_supported"


def test_health_answers_during_a_12_mb_request(server):
    """The 12 MB chat request is refused by its length alone; /health stays quick while it is read and handled."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "word " * (12 * 1024 * 1024 // 5)}]}
    result: dict = {}

    def post() -> None:
        start = time.monotonic()
        result["reply"] = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers, timeout=120)
        result["seconds"] = time.monotonic() - start

    sender = threading.Thread(target=post)
    with httpx.Client(base_url=server.url, timeout=30) as client:
        client.get("/health")  # connection up before the clock starts
        sender.start()
        latencies = []
        while sender.is_alive():
            start = time.monotonic()
            assert client.get("/health").status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.02)
    sender.join()
    reply = result["reply"]
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == "context_length_exceeded" and f"context length of {CONTEXT}" in error["message"]
    assert len(latencies) >= 3, result  # the request really was in flight meanwhile
    assert max(latencies) < 0.5, (max(latencies), result["seconds"])
    assert result["seconds"] < 20
