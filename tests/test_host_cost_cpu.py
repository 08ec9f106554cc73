"""``bench/host_cost_cpu.py`` runs the real engine with its launches stubbed and reports what it measured."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_host_cost_driver_reports_host_time_and_launches():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "host_cost_cpu.py"), "--layers", "4", "--blocks", "2",
                          "--per-block", "1", "--tokens", "16"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    found = re.search(r"host ([\d.]+) ms best, ([\d.]+) ms median per request; (\d+) Triton launches", out.stdout)
    assert found, out.stdout[-2000:]
    assert 0 < float(found[1]) <= float(found[2])
    # per 4-layer forward: 3 GDN layers and one attention layer, each with norms, its mixer's kernels and the MoE
    assert int(found[3]) >= 40
