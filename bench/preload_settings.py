"""``decode_ab.py`` settings for the batch-1 ``preload`` experiments: weights read before the PDL wait.

Prints one setting (a JSON object of environment variables: ``ARMILLARY_TUNING`` holding table entries) by name,
for ``--setting "$(python bench/preload_settings.py NAME)"``. Each ``*_tiles`` setting is its ``*_preload``
twin without the preload keys, so an A/B separates the tile change from the preload:

    python bench/decode_ab.py --model qwen --fp8 --streams 1 --setting '{}' \\
        --setting "$(python bench/preload_settings.py qwen_fp8_tiles)" \\
        --setting "$(python bench/preload_settings.py qwen_fp8_preload)" \\
        --setting "$(python bench/preload_settings.py qwen_fp8_all)"
    python bench/decode_ab.py --model glm --streams 1 --setting '{}' \\
        --setting "$(python bench/preload_settings.py glm_tiles)" \\
        --setting "$(python bench/preload_settings.py glm_preload)"
"""
from __future__ import annotations

import json
import sys

# Qwen3.6 fp8 projections at one row (GDN in_proj, attention qkv, o_proj / out_proj): 4 warps, K tiles merged
QWEN_FP8_SKINNY = {
    "n12352_k2048_m1": {"BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4, "split_k": 1},
    "n9216_k2048_m1": {"BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4, "split_k": 1},
    "n2048_k4096_m1": {"BLOCK_N": 8, "BLOCK_K": 2048, "num_warps": 4, "split_k": 1},
}
# the GDN decode kernel's batch-1 value split with its state tile read before the wait (batch 8 as the table)
QWEN_GDN = {"default": {"by_batch": {"1": {"split_bv": 16, "num_warps": 1, "preload": True},
                                     "8": {"split_bv": 64, "num_warps": 2}}}}
# the router (256 experts + the shared gate) on the Triton skinny GEMV instead of cuBLAS, which breaks the PDL chain
QWEN_ROUTER = {"n257_k2048_m1": {"use": True, "path": "fma", "BLOCK_M": 1, "BLOCK_N": 2, "BLOCK_K": 2048,
                                 "split_k": 1, "num_warps": 4, "preload": True}}
QWEN_FP8_MOE = {"e257_h2048_i512_k9_t1": {"down_preload": True}}
# GLM-4.7-Flash bf16 projections at one row: 8 rows a program, the K range cut to <= 32 KB tiles
GLM_SKINNY = {
    "n1344_k2048_m1": {"BLOCK_N": 8, "split_k": 1, "num_warps": 4},
    "n2048_k5120_m1": {"BLOCK_N": 8, "split_k": 3, "num_warps": 8},
    "n2048_k10240_m1": {"BLOCK_N": 8, "split_k": 5, "num_warps": 8},
    "n5120_k768_m1": {"BLOCK_N": 8, "split_k": 1, "num_warps": 4},
    "n8960_k512_m1": {"BLOCK_N": 8, "split_k": 1, "num_warps": 4},
    "n20480_k2048_m1": {"BLOCK_N": 8, "split_k": 1, "num_warps": 4},
}


def _with(entries: dict, preload: bool) -> dict:
    return {key: {**entry, "preload": preload} for key, entry in entries.items()}


SETTINGS = {
    "qwen_fp8_tiles": {"fp8_skinny": QWEN_FP8_SKINNY},
    "qwen_fp8_preload": {"fp8_skinny": _with(QWEN_FP8_SKINNY, True)},
    "qwen_fp8_all": {"fp8_skinny": _with(QWEN_FP8_SKINNY, True), "gdn_decode": QWEN_GDN,
                     "skinny_gemm": QWEN_ROUTER, "fp8_moe_gemv": QWEN_FP8_MOE},
    "glm_tiles": {"skinny_gemm": _with(GLM_SKINNY, False)},
    "glm_preload": {"skinny_gemm": _with(GLM_SKINNY, True)},
}


def setting(name: str) -> str:
    """The named setting as ``decode_ab.py --setting`` takes it."""
    if name not in SETTINGS:
        raise SystemExit(f"unknown setting {name!r}: {', '.join(SETTINGS)}")
    return json.dumps({"ARMILLARY_TUNING": json.dumps(SETTINGS[name])})


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: python bench/preload_settings.py NAME ({', '.join(SETTINGS)})")
    print(setting(sys.argv[1]))
