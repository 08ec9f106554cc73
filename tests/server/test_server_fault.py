"""Fail fast on a broken device: a step that raises fails every request in flight with a 5xx in its protocol's
shape (whole or streamed), turns /health to 503 and exits the process non-zero within 10 s."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from tests.server.faulty_serve import INJECTED, TRIGGER_ENV
from tests.server.live_server import MODEL_NAME

LONG = {"max_tokens": 900, "ignore_eos": True, "temperature": 0.0}
USER = [{"role": "user", "content": "Tell me a long story."}]
# Messages has no ignore_eos: this greedy reply of the tiny model runs 236 tokens, far past the fault
LONG_GREEDY = [{"role": "user", "content": "Hello there"}]
THINKING = {"max_tokens": 900, "temperature": 0.0, "thinking": {"type": "enabled", "budget_tokens": 1000}}
REQUESTS = {  # name -> (path, body); every one runs far longer than the test waits
    "chat": ("/v1/chat/completions", {"messages": USER, **LONG}),
    "chat_stream": ("/v1/chat/completions", {"messages": USER, "stream": True, **LONG}),
    "messages": ("/v1/messages", {"messages": LONG_GREEDY, **THINKING}),
    "messages_stream": ("/v1/messages", {"messages": LONG_GREEDY, "stream": True, **THINKING}),
    "responses": ("/v1/responses", {"input": "Tell me a long story.", "max_output_tokens": 900, "ignore_eos": True}),
    "responses_stream": ("/v1/responses", {"input": "Tell me a long story.", "max_output_tokens": 900,
                                           "ignore_eos": True, "stream": True}),
}


def start_faulty(checkpoint: Path, log_path: Path, trigger: Path) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "tests.server.faulty_serve", "serve", str(checkpoint), "--dtype", "float32",
           "--served-model-name", MODEL_NAME, "--port", "0", "--max-model-len", "1024", "--disable-log-stats"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", TRIGGER_ENV: str(trigger)}
    env.pop("ARMILLARY_API_KEY", None)
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                cwd=str(Path(__file__).parents[2]))
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        found = re.search(r"listening on (http://\S+)", log_path.read_text(errors="replace"))
        if found:
            return proc, found.group(1)
        assert proc.poll() is None, log_path.read_text()
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"the server did not start:\n{log_path.read_text()}")


def run_request(url: str, path: str, body: dict, first_output: threading.Event, result: dict) -> None:
    """Send one request; for a stream, set ``first_output`` on its first content event and keep every event."""
    try:
        with httpx.stream("POST", url + path, json={"model": MODEL_NAME, **body}, timeout=60) as r:
            result["status"] = r.status_code
            lines = []
            for line in r.iter_lines():
                lines.append(line)
                if "delta" in line:
                    first_output.set()
            result["body"] = "\n".join(lines)
    except httpx.HTTPError as exc:
        result["error"] = repr(exc)
    finally:
        first_output.set()


def test_step_exception_fails_requests_turns_health_503_and_exits(tiny_checkpoint, tmp_path):
    trigger = tmp_path / "fault"
    log_path = tmp_path / "serve.log"
    proc, url = start_faulty(tiny_checkpoint, log_path, trigger)
    try:
        results: dict[str, dict] = {name: {} for name in REQUESTS}
        started: dict[str, threading.Event] = {name: threading.Event() for name in REQUESTS}
        threads = [threading.Thread(target=run_request, args=(url, path, body, started[name], results[name]))
                   for name, (path, body) in REQUESTS.items()]
        for t in threads:
            t.start()
        for name in REQUESTS:
            if name.endswith("_stream"):
                assert started[name].wait(60), name
        deadline = time.monotonic() + 30  # the whole requests are running too
        while httpx.get(f"{url}/metrics").text.count("armillary_num_requests_running 6.0") == 0:
            assert time.monotonic() < deadline, httpx.get(f"{url}/metrics").text
            time.sleep(0.05)
        assert httpx.get(f"{url}/health").status_code == 200
        trigger.touch()
        fault_at = time.monotonic()
        health: list[int] = []
        while proc.poll() is None and time.monotonic() - fault_at < 15:
            try:
                health.append(httpx.get(f"{url}/health", timeout=1).status_code)
            except httpx.HTTPError:
                pass  # the port has closed: the process is on its way out
            time.sleep(0.05)
        code = proc.wait(timeout=max(0.1, 10 - (time.monotonic() - fault_at)))
        exited_after = time.monotonic() - fault_at
        for t in threads:
            t.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = log_path.read_text(errors="replace")
    assert code == 3 and exited_after < 10, (code, exited_after, log)
    assert 503 in health and set(health) <= {200, 503} and health[-1] == 503, health
    assert "exiting with status 3: the engine failed" in log
    for name in ("chat", "responses"):  # OpenAI shape
        assert results[name]["status"] == 500, (name, results[name])
        error = json.loads(results[name]["body"])["error"]
        assert error["type"] == "server_error" and INJECTED in error["message"] and error["code"] == "engine_failed"
    assert results["messages"]["status"] == 500
    assert json.loads(results["messages"]["body"])["error"]["type"] == "api_error"
    chat = results["chat_stream"]["body"].splitlines()
    assert chat[-1] == "data: [DONE]" and INJECTED in chat[-3] and '"server_error"' in chat[-3]
    messages = results["messages_stream"]["body"]
    assert "event: error" in messages and '"api_error"' in messages and INJECTED in messages
    responses = results["responses_stream"]["body"]
    failed = json.loads(responses.splitlines()[-1][len("data: "):])
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert INJECTED in failed["response"]["error"]["message"]
