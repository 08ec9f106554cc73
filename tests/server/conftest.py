"""Session fixtures: a tiny qwen3_next checkpoint and the shared ``armillary serve`` subprocess."""
from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.fixtures.tiny_models import save_tiny_model
from tests.server.live_server import API_KEY, start_server



@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("server_tiny_qwen3_next")
    save_tiny_model(path)
    return path


@pytest.fixture(scope="session")
def server(tiny_checkpoint, tmp_path_factory):
    """The shared server: API key on, a small body limit so 413 is cheap to provoke."""
    log_path = tmp_path_factory.mktemp("server_logs") / "serve.log"
    live = start_server(tiny_checkpoint, log_path, "--api-key", API_KEY, "--max-model-len", "1024",
                        "--max-request-body-bytes", "65536")
    yield live
    code = live.stop(signal.SIGINT)  # Ctrl-C is as graceful as SIGTERM
    assert code == 0, f"server exited with {code}:\n{live.log()}"
