"""Run ``armillary serve`` as a subprocess on a free loopback port and talk to it."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

API_KEY = "test-key"
MODEL_NAME = "tiny"
_LISTENING = re.compile(r"listening on (http://\S+)")


@dataclass
class LiveServer:
    proc: subprocess.Popen
    url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as {sample name with labels: value}."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        return values


def start_server(checkpoint: Path | None, log_path: Path, *extra: str, timeout: float = 180.0) -> LiveServer:
    """``checkpoint=None`` starts ``armillary serve`` with no model: the plugins' default model."""
    model = [str(checkpoint), "--dtype", "float32", "--served-model-name", MODEL_NAME] if checkpoint else []
    cmd = [sys.executable, "-m", "armillary.cli", "serve", *model, "--port", "0", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("ARMILLARY_API_KEY", None)
    log_file = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=str(Path(__file__).parents[2]))
    log_file.close()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = _LISTENING.search(log_path.read_text(errors="replace"))
        if found:
            return LiveServer(proc, found.group(1), log_path)
        if proc.poll() is not None:
            raise RuntimeError(f"armillary serve exited with {proc.returncode}:\n{log_path.read_text()}")
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"armillary serve did not start in {timeout}s:\n{log_path.read_text()}")
