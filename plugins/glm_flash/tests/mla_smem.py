"""Shared memory of the decode step's MLA / router kernel launches at GLM-4.7-Flash's shape, compiled offline
for sm_90.

Run as a script (``test_mla_kernels`` does, in a subprocess without TRITON_INTERPRET): records the
launches ``mla_decode`` makes for each config, and those of ``mla_absorb_rope_store`` / ``mla_absorb`` /
``mla_decode_values`` / ``router_logits`` at 1, 8 and 64 rows (``router_topk`` and the sm_90 table's
``norm_gemv`` launches at 1 and 8), with bench/smem_check.py's recorder,
compiles each distinct one and prints ``[{"config": ..., "kernel": ..., "shared": bytes}]`` as JSON.
"""
from __future__ import annotations

import os

os.environ.pop("TRITON_INTERPRET", None)  # before any triton import: kernels must be JITFunctions

import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import smem_check  # noqa: E402

from armillary_glm_flash.ops import norm_gemv, router, router_topk  # noqa: E402
from armillary_glm_flash.ops.mla import absorb, decode, expand  # noqa: E402
from armillary.kernels.triton.host import next_power_of_2  # noqa: E402

# the sm_90 table's norm_gemv launches (this CPU reads no sm_90 table by itself)
NORM_GEMV = json.loads((Path(norm_gemv.__file__).parents[1] / "tuning" / "sm_90.json").read_text())["norm_gemv"]
CONFIGS = [dict(decode.DEFAULTS),  # the shipped default, and the largest tile the sweep tries
           dict(decode.DEFAULTS, BLOCK_H=32, BLOCK_N=64, num_warps=8, num_stages=1)]


def main() -> None:
    launches: list = []
    label = [""]
    JITFunction.run = lambda kernel, *args, grid, warmup, **kw: launches.append(
        smem_check.Launch(kernel, args, kw, label[0]))
    batch, heads, dl, dr = 4, 20, 512, 64
    kv = torch.zeros(10, 16, dl + dr, dtype=torch.bfloat16)
    tables, lens = torch.zeros(batch, 4, dtype=torch.int32), torch.ones(batch, dtype=torch.int32)
    q_lat = torch.zeros(batch, heads, dl, dtype=torch.bfloat16)
    q_pe = torch.zeros(batch, heads, dr, dtype=torch.bfloat16)
    for cfg in CONFIGS:
        label[0] = json.dumps(cfg)
        decode.mla_decode(q_lat, q_pe, kv, tables, lens, 0.1, 4096, config=cfg, num_splits=4)  # split + combine
    nope, v, bf16 = 192, 256, torch.bfloat16
    w = torch.zeros(heads, nope + v, dl, dtype=bf16)
    for rows, splits in ((1, 64), (8, 33), (64, 5), (64, 1)):  # the bench's split counts at a 16K graph bound
        label[0] = f"rows {rows}, {splits} splits"
        q = torch.zeros(rows, heads, nope + dr, dtype=bf16)
        ckv, cos = torch.zeros(rows, dl + dr, dtype=bf16), torch.zeros(rows, dr // 2)
        absorb.mla_absorb_rope_store(q, w[:, :nope], ckv, torch.ones(dl, dtype=bf16), 1e-6, cos, cos, kv,
                                     torch.zeros(rows, dtype=torch.long), True)
        absorb.mla_absorb(q[..., :nope], w[:, :nope])
        tables, lens = torch.zeros(rows, 4, dtype=torch.int32), torch.ones(rows, dtype=torch.int32)
        q_lat, q_pe = torch.zeros(rows, heads, dl, dtype=bf16), q[..., nope:]
        expand.mla_decode_values(q_lat, q_pe, kv, tables, lens, 0.1, 16896, w[:, nope:], num_splits=splits)
        router.router_logits(torch.zeros(rows, 2048, dtype=bf16), torch.zeros(64, 2048))
        if rows <= router_topk.MAX_ROWS:  # the one-launch router, plain and group-limited; q_b with its norm
            for groups in ({}, {"n_group": 8, "topk_group": 4}):
                router_topk.router_topk(torch.zeros(rows, 2048, dtype=bf16), torch.zeros(64, 2048), torch.zeros(64),
                                        4, True, 1.8, 1, **groups)
            m = next_power_of_2(rows)
            norm_gemv.norm_gemv(torch.zeros(rows, 768, dtype=bf16), torch.ones(768, dtype=bf16), 1e-6,
                                torch.zeros(5120, 768, dtype=bf16), config=NORM_GEMV[f"n5120_k768_m{m}"])
    target = smem_check.TARGETS["sm_90"]
    jobs: dict = {}
    smem_check.compile_jobs(launches, target, "real-bf16", jobs)
    rows = [{"config": job.uses["real-bf16"], "kernel": job.kernel.fn.__name__, "shared": smem_check.shared_bytes(job),
             "limit": target.smem_limit} for job in jobs.values()]
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
