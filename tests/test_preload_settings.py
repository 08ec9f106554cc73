"""bench/preload_settings.py: every named setting parses as ``ARMILLARY_TUNING`` and its entries reach the launch
configs they are meant for (the fp8 / bf16 skinny GEMVs, the GDN decode kernel, the fp8 MoE GEMV)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from armillary.kernels import tuning
from armillary.kernels.triton import fp8_moe, fp8_skinny, skinny_gemm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import preload_settings  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture
def env_table():
    def use(name: str) -> None:
        tuning.use_env_table(json.loads(preload_settings.setting(name))["ARMILLARY_TUNING"])

    yield use
    tuning.use_env_table("")


@pytest.mark.parametrize("name", list(preload_settings.SETTINGS))
def test_every_setting_is_a_tuning_table(name):
    env = json.loads(preload_settings.setting(name))
    assert list(env) == ["ARMILLARY_TUNING"] and tuning.parse_env_table(env["ARMILLARY_TUNING"])


def test_qwen_settings_reach_their_launches(env_table, monkeypatch):
    from armillary_qwen_gdn_moe.ops.gated_delta_rule import fused_recurrent

    monkeypatch.setattr(fp8_skinny, "OFFLINE_SM_COUNT", 132)  # GPU launch configs without a GPU
    for name, preload in (("qwen_fp8_tiles", False), ("qwen_fp8_preload", True)):
        env_table(name)
        for n, k in ((12352, 2048), (9216, 2048), (2048, 4096)):
            cfg = fp8_skinny.decode_config(1, n, k, 128, 128, CPU)
            assert cfg["preload"] == preload and cfg["num_warps"] == 4 and cfg["split_k"] == 1
            assert cfg["K_TILES"] == (1 if preload else k // cfg["NSUB"] // cfg["SUB_K"])
    env_table("qwen_fp8_all")
    assert fused_recurrent.decode_config(1, 128, 128, CPU)["preload"]
    assert not fused_recurrent.decode_config(8, 128, 128, CPU).get("preload", False)
    router = skinny_gemm.lookup_config(1, 257, 2048, CPU)
    assert router["use"] and skinny_gemm._launch_shape(router, 1, 257, 2048, 2, CPU)["PRELOAD"]
    assert fp8_moe.gemv_config(257, 2048, 512, 9, 1, CPU)["down_preload"]


def test_glm_settings_reach_the_skinny_gemm(env_table):
    for name, preload in (("glm_tiles", False), ("glm_preload", True)):
        env_table(name)
        for key, entry in preload_settings.GLM_SKINNY.items():
            n, k = (int(part[1:]) for part in key.split("_")[:2])
            launch = skinny_gemm._launch_shape(skinny_gemm.lookup_config(1, n, k, CPU), 1, n, k, 2, CPU)
            assert launch["PRELOAD"] == preload and launch["BLOCK_N"] == entry["BLOCK_N"]
            if preload:  # one K block a program, at most 32 KB of bf16 weights
                assert launch["blocks_per_split"] == 1 and entry["BLOCK_N"] * launch["BLOCK_K"] * 2 <= 32768
