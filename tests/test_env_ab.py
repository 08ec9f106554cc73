"""bench/env_ab.py: runs alternate between settings, each run's figures are kept under its setting, a failed run fails it."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "env_ab.py"
FAKE = "import os; print('decode b1: engine.step() %s ms (1 tok/s)' % (2.5 + int(os.environ['X']))); print('noise')"


def test_alternates_settings_and_reports_medians():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--env", "X=0", "--env", "X=1", "--repeat", "2", "--",
                           sys.executable, "-c", FAKE], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    runs = [line for line in proc.stdout.splitlines() if line.startswith("--- run")]
    assert [r.split(",")[1].split(":")[0].strip() for r in runs] == ["X=0", "X=1", "X=0", "X=1"]
    medians = proc.stdout.split("medians (ms):")[1]
    assert "X=0" in medians and "2.500  (2.500, 2.500)" in medians and "3.500  (3.500, 3.500)" in medians


def test_a_failing_run_fails_the_comparison():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--env", "X=0", "--repeat", "1", "--", sys.executable, "-c",
                           "raise SystemExit(3)"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "exit 3" in proc.stdout
