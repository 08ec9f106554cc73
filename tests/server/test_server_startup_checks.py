"""``armillary serve`` mistakes fail fast, before any weights load: one error line (and a hint), exit 1, no traceback."""
from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from armillary.errors import ModelNotFoundError
from armillary.server import cli as serve_cli
from armillary.server.startup_checks import describe_failure

ROOT = Path(__file__).parents[2]


def _serve(*args: str, timeout: float = 90.0) -> tuple[int, str, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("ARMILLARY_API_KEY", None)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "armillary.cli", "serve", *args], capture_output=True, text=True,
                          env=env, cwd=str(ROOT), timeout=timeout)
    return done.returncode, done.stdout + done.stderr, time.monotonic() - start


def _error_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if " ERROR " in line]


def _assert_fails_fast(log: str, code: int, elapsed: float, *expected: str) -> None:
    assert code == 1, log
    assert elapsed < 8.0, f"took {elapsed:.1f}s:\n{log}"  # no model is built (torch is not even imported)
    assert "weights loaded" not in log and "loading " not in log and "Traceback" not in log, log
    errors = _error_lines(log)
    assert 1 <= len(errors) <= 2 and all(e in errors[0] for e in expected), log
    assert len(errors) == 1 or "hint: " in errors[1], log


def test_busy_port(tiny_checkpoint):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, log, elapsed = _serve(str(tiny_checkpoint), "--port", str(port))
    _assert_fails_fast(log, code, elapsed, f"127.0.0.1:{port}", "the port is in use", "--port 0")


@pytest.mark.parametrize("args, expected", [
    (("--port", "99999"), ("--port 99999 is not a TCP port",)),
    (("--host", "192.0.2.1", "--port", "0"), ("'192.0.2.1' is not an address of this machine",)),
    (("--tool-call-parser", "nope"), ("--tool-call-parser 'nope': no such tool parser", "qwen3_coder")),
    (("--reasoning-parser", "qwen3_coder"), ("'qwen3_coder' is a tool parser", "registered reasoning parsers:", "qwen3, or 'none'")),
    (("--max-num-seqs", "0"), ("--max-num-seqs must be an integer of at least 1, not 0",)),
    (("--max-num-batched-tokens", "0"), ("--max-num-batched-tokens must be",)),
    (("--dtype", "int3"), ("unsupported --dtype 'int3'", "bfloat16")),
    (("--gpu-memory-utilization", "1.5"), ("--gpu-memory-utilization must be in (0, 1]",)),
    (("--block-size", "12"), ("--block-size must be a power of two",)),
    (("--kernel-backend", "cutlass"), ("--kernel-backend must be one of auto, reference, triton",)),
    (("--load-format", "pt"), ("--load-format must be one of auto, dummy",)),
    (("--enable-prefix-caching", "--ssm-checkpoint-interval", "100"),
     ("--state-checkpoint-interval must be a positive multiple of --block-size (16), not 100",)),
    (("--chat-template", "/no/such/template.jinja"), ("looks like a file path but cannot be read",)),
    (("--chat-template", "{% if %}"), ("chat template does not compile",)),
    (("--generation-config", "/no/such/folder"), ("a folder holding a generation_config.json",)),
    (("--max-logprobs", "-1"), ("--max-logprobs must be 0 or more",)),
])
def test_bad_flag_fails_before_loading(tiny_checkpoint, args, expected):
    code, log, elapsed = _serve(str(tiny_checkpoint), "--port", "0", *args)
    _assert_fails_fast(log, code, elapsed, *expected)


def test_missing_model_is_one_line_with_a_hint(tmp_path):
    code, log, _ = _serve(str(tmp_path / "nowhere"), "--port", "0")
    assert code == 1 and "Traceback" not in log, log
    errors = _error_lines(log)
    assert len(errors) == 2 and "does not exist" in errors[0] and "hint: " in errors[1], log


def test_unserved_architecture_at_load_is_one_line(tiny_checkpoint, tmp_path):
    """Found while loading (after the flags passed): still one line, no traceback, and the listed plugins."""
    model = tmp_path / "unserved"
    shutil.copytree(tiny_checkpoint, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "architectures": ["NobodyServesThisForCausalLM"]}))
    code, log, _ = _serve(str(model), "--port", "0")
    assert code == 1 and "Traceback" not in log and "weights loaded" not in log, log
    errors = _error_lines(log)
    assert "no installed plugin serves architecture ['NobodyServesThisForCausalLM']" in errors[0], log
    assert "qwen_gdn_moe" in errors[0] and "armillary plugins" in errors[1], log


def test_a_bug_keeps_its_traceback(caplog):
    assert describe_failure(KeyError("x")) is None
    assert describe_failure(ModelNotFoundError("gone"))[0] == "gone"
    assert describe_failure(MemoryError("KV pool too small"))[0].startswith("out of memory")
    with caplog.at_level(logging.ERROR, logger="armillary.server"):
        try:
            raise KeyError("an internal slip")
        except KeyError as exc:
            assert serve_cli._report("m", exc) == 1
    assert caplog.records[-1].exc_info is not None and "internal error" in caplog.records[-1].getMessage()
