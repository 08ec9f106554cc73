"""Operations through a live ``armillary serve``: CORS, HEAD /health, /version, access and throughput log
lines, vLLM flags that act (--chat-template file, --trust-remote-code), and a broken plugin beside it."""
from __future__ import annotations

import json
import os
import re
import time

import httpx
import pytest
from tokenizers import Tokenizer as BackendTokenizer

import armillary
from tests.fixtures.broken_plugins import IMPORT_FAILS, write_broken_plugins
from tests.server.live_server import MODEL_NAME, start_server

ORIGIN = "http://app.example"
TEMPLATE = ("{% for m in messages %}[custom {{ m.role }}] {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}[custom assistant] {% endif %}")


@pytest.fixture(scope="module")
def ops_server(tiny_checkpoint, tmp_path_factory):
    """No API key; CORS for one origin; a chat template file; a throughput line every 0.5 s; two broken
    plugins installed beside the real ones."""
    tmp = tmp_path_factory.mktemp("ops")
    (tmp / "custom.jinja").write_text(TEMPLATE)
    site = write_broken_plugins(tmp / "site")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
        mp.delenv("ARMILLARY_DISABLE_PLUGINS", raising=False)
        live = start_server(tiny_checkpoint, tmp / "serve.log", "--max-model-len", "512",
                            "--allowed-origins", f'["{ORIGIN}"]', "--chat-template", str(tmp / "custom.jinja"),
                            "--trust-remote-code", "--log-stats-interval", "0.5", "--generation-config", "vllm")
    yield live
    assert live.stop() == 0, live.log()


def _lines(live, pattern: str) -> list[str]:
    return [line for line in live.log().splitlines() if re.search(pattern, line)]


def _wait_for(live, pattern: str, count: int = 1, timeout: float = 20.0) -> list[str]:
    """The matching lines once there are ``count`` (the line is written just after the response ends)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = _lines(live, pattern)
        if len(found) >= count:
            return found
        time.sleep(0.1)
    raise AssertionError(f"no log line matches {pattern!r}:\n{live.log()}")


def test_starts_beside_broken_plugins_and_says_what_flags_do(ops_server):
    log = ops_server.log()
    assert "Traceback" not in log
    broken = _lines(ops_server, rf"plugin '{IMPORT_FAILS}' .* is skipped")
    assert len(broken) == 1 and f"ARMILLARY_DISABLE_PLUGINS={IMPORT_FAILS}" in broken[0]
    assert "broken plugins skipped: " in log and "qwen_gdn_moe" in log
    assert "armillary never runs code shipped with a checkpoint" in log
    assert "chat template: the one given" in log


def test_cors_preflight_and_simple_request(ops_server):
    pre = httpx.options(f"{ops_server.url}/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in pre.headers["access-control-allow-methods"]
    got = httpx.get(f"{ops_server.url}/v1/models", headers={"Origin": ORIGIN})
    assert got.status_code == 200 and got.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.get(f"{ops_server.url}/v1/models", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in other.headers


def test_head_health_and_version(ops_server):
    head = httpx.head(f"{ops_server.url}/health")
    assert head.status_code == 200 and head.content == b""
    assert httpx.get(f"{ops_server.url}/version").json() == {"version": armillary.__version__}


def test_chat_template_flag_replaces_the_checkpoint_template(ops_server, tiny_checkpoint):
    messages = [{"role": "user", "content": "hello there"}]
    got = httpx.post(f"{ops_server.url}/tokenize", json={"model": MODEL_NAME, "messages": messages}).json()
    backend = BackendTokenizer.from_file(str(tiny_checkpoint / "tokenizer.json"))
    expected = "[custom user] hello there\n[custom assistant] "
    assert got["tokens"] == backend.encode(expected, add_special_tokens=False).ids


def test_access_lines_and_throughput_line(ops_server):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "count"}], "max_tokens": 4,
            "ignore_eos": True, "temperature": 0}
    reply = httpx.post(f"{ops_server.url}/v1/chat/completions", json=body, timeout=60).json()
    prompt, output = reply["usage"]["prompt_tokens"], reply["usage"]["completion_tokens"]
    line = _wait_for(ops_server, r'"POST /v1/chat/completions" 200 ')[-1]
    assert f"prompt_tokens={prompt} output_tokens={output} " in line and output == 4
    assert re.search(r"ttft=\d+\.\d{3}s duration=\d+\.\d{3}s$", line), line
    streamed = {**body, "stream": True}
    with httpx.stream("POST", f"{ops_server.url}/v1/chat/completions", json=streamed, timeout=60) as resp:
        assert resp.status_code == 200 and list(resp.iter_lines())[-2:] == ["data: [DONE]", ""]
    assert len(_wait_for(ops_server, rf'"POST /v1/chat/completions" 200 prompt_tokens={prompt} output_tokens=4 ',
                         count=2)) == 2
    bad = httpx.post(f"{ops_server.url}/v1/chat/completions", json={"model": MODEL_NAME, "messages": []})
    assert bad.status_code == 400
    error_line = _wait_for(ops_server, r'"POST /v1/chat/completions" 400 ')[-1]
    assert "error='invalid request: messages:" in error_line and " INFO " in error_line
    assert _wait_for(ops_server, r'"HEAD /health" 200 duration=')
    throughput = _wait_for(ops_server, r"throughput: prompt \d+\.\d tokens/s, generation \d+\.\d tokens/s; "
                                       r"running \d+, waiting \d+; KV cache \d+\.\d% used")
    assert throughput
    idle_count = len(_lines(ops_server, "throughput: "))
    time.sleep(1.5)  # idle: no more lines
    assert len(_lines(ops_server, "throughput: ")) <= idle_count + 1


def test_generation_config_vllm_drops_the_checkpoint_sampling_defaults(tiny_checkpoint):
    from armillary.config import EngineConfig
    from armillary.model_source import open_model_source
    from armillary.registry import PluginRegistry

    reg = PluginRegistry()
    checkpoint = json.loads((tiny_checkpoint / "generation_config.json").read_text())
    auto = open_model_source(str(tiny_checkpoint), None, reg, EngineConfig(str(tiny_checkpoint)))
    assert auto.generation_defaults()["temperature"] == checkpoint["temperature"]
    vllm = open_model_source(str(tiny_checkpoint), None, reg, EngineConfig(str(tiny_checkpoint),
                                                                           generation_config="vllm"))
    assert vllm.generation_defaults() == {"eos_token_id": checkpoint["eos_token_id"]}
