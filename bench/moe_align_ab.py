"""moe_align at decode-batch pair counts (GPU): the one-program path against the memset + two launches, both inside
CUDA graphs of 20 calls (µs a call), checked equal first; prints the largest pair count at which one program is
faster: the ``moe_align`` entry's ``one_program_max_pairs`` for the core table.

    python bench/moe_align_ab.py [--tokens 8,16,32,48,64,96,128,160,192,227] [--experts 257] [--slots 9] [--block-m 16]

Token counts whose pairs exceed ``ONE_PROGRAM_LIMIT`` are skipped (one program cannot hold them).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_kernels import bench_ms  # noqa: E402

from armillary.kernels.triton.moe_align import ONE_PROGRAM_LIMIT, moe_align

CALLS = 20  # per graph: a decode step's layers run the sort back to back, so launch gaps count


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="8,16,32,48,64,96,128,160,192,227")
    ap.add_argument("--experts", type=int, default=257, help="routed + shared (Qwen3.6: 256 + 1)")
    ap.add_argument("--slots", type=int, default=9, help="pairs a token: top-k + shared")
    ap.add_argument("--block-m", type=int, default=16)
    args = ap.parse_args()
    rows, best = {}, 0
    for t in (int(x) for x in args.tokens.split(",")):
        if t * args.slots > ONE_PROGRAM_LIMIT:
            print(f"T={t} ({t * args.slots} pairs): over ONE_PROGRAM_LIMIT {ONE_PROGRAM_LIMIT}, skipped", flush=True)
            continue
        g = torch.Generator(device="cuda").manual_seed(t)
        routed = torch.randint(0, args.experts - 1, (t, args.slots - 1), device="cuda", generator=g)
        ids = torch.cat([routed, torch.full((t, 1), args.experts - 1, device="cuda")], 1).to(torch.int32)
        one, two = (moe_align(ids, args.experts, args.block_m, one_program=f) for f in (True, False))
        same = all(torch.equal(getattr(one, n), getattr(two, n)) for n in ("expert_counts", "expert_offsets",
                                                                              "block_expert"))
        times = {}
        for name, flag in (("one_program", True), ("two_launches", False)):
            def calls(flag=flag):
                for _ in range(CALLS):
                    moe_align(ids, args.experts, args.block_m, one_program=flag)
            times[name] = bench_ms(calls, graph=True) * 1e3 / CALLS
        rows[t] = {"pairs": t * args.slots, "equal": same, **times}
        if same and times["one_program"] < times["two_launches"]:
            best = t * args.slots
        print(f"T={t} ({t * args.slots} pairs): equal {same}; one program {times['one_program']:.2f} us, memset + two "
              f"launches {times['two_launches']:.2f} us", flush=True)
    print(f"one_program_max_pairs: {best}  (the largest pair count measured faster in one program)")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "moe_align_ab.json").write_text(json.dumps({"rows": rows, "best": best}, indent=1))


if __name__ == "__main__":
    main()
