"""The plugin's Triton kernels (Mamba-2 scans and decode step, the router's logits, the grouped top-k it uses) compile for sm_90 (offline, no GPU) at the Nano and the tiny test shapes, fit its shared memory, and the Mamba kernels order their in-place stores after their reads.

Runs ``plugins/nemotron/bench/smem_check.py`` and ``store_order_check.py`` in subprocesses without
TRITON_INTERPRET (the interpreter replaces kernels when they are defined, so they could not be
compiled here; it also runs each op on whole tensors, so it never shows a race between threads).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_mamba_kernels_compile_for_sm90_and_fit():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "plugins/nemotron/bench/smem_check.py"), "--targets", "sm_90",
                           "--json", "-"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode in (0, 1), proc.stderr[-4000:]
    rows = json.loads(proc.stdout)
    assert {(r["shapes"], r["kernel"]) for r in rows} == {
        (s, k) for s in ("nano-bf16", "tiny-fp32")
        for k in ("_ssd_scan_kernel", "_chunk_state_kernel", "_state_pass_kernel", "_chunk_scan_kernel",
                  "_gated_group_norm_kernel", "_mamba_decode_kernel", "_mamba_decode_split_kernel", "_route_kernel",
                  "_router_fma_kernel", "_router_dot_kernel")}
    over = [r for r in rows if not r["fits"]]
    assert not over, over


def test_mamba_in_place_stores_follow_a_barrier_after_every_read():
    """No conv-window or state store of the decode step or the scans (nor of the chunked scan's hand-over
    scratch) may overtake a load of the same buffer by another thread (the race the interpreter cannot show): a
    barrier lies between them in the sm_90 TTGIR. The chunked scan's two chunk passes rewrite nothing they read."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "plugins/nemotron/bench/store_order_check.py"), "--warps", "4,8",
                           "--json", "-"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode in (0, 1), proc.stderr[-4000:]
    rows = json.loads(proc.stdout)
    assert {(r["shapes"], r["num_warps"], r["kernel"]) for r in rows} == {
        (s, w, k) for s in ("nano-bf16", "tiny-fp32", "odd-fp32") for w in (4, 8)
        for k in ("_mamba_decode_kernel", "_mamba_decode_split_kernel", "_ssd_scan_kernel", "_chunk_state_kernel",
                  "_state_pass_kernel", "_chunk_scan_kernel")}
    assert all(r["stores"] > 0 for r in rows), rows
    in_place = [r for r in rows if r["kernel"] not in ("_chunk_state_kernel", "_chunk_scan_kernel")]
    assert all(r["barriers"] > 0 for r in in_place), in_place
    unordered = [(r["shapes"], r["num_warps"], r["unordered"][:2]) for r in rows if r["unordered"]]
    assert not unordered, unordered
