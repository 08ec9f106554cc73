"""Ranks a launcher starts (torchrun on the CPU, gloo): the same script on two processes gives rank 0 the greedy
tokens of one process while rank 1 follows and exits cleanly; a launcher's world must match the parallel sizes;
``armillary serve`` on a rank above 0 follows rank 0 and binds no port; the launcher's variables are read right."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap

import pytest

from armillary.testing import greedy_params
from armillary.worker import ranks
from tests.test_tensor_parallel import _save_llama, make_llm

SCRIPT = textwrap.dedent('''
    import json, sys
    import armillary_llama.hooks as llama_hooks
    from armillary import LLM, SamplingParams
    from armillary.registry import PluginRegistry

    if __name__ == "__main__":
        registry = PluginRegistry()
        registry.register(llama_hooks, "llama", distribution="armillary-llama")
        llm = LLM(sys.argv[1], registry=registry, dtype="float32", device="cpu", max_model_len=256, block_size=8,
                  max_num_seqs=8, max_num_batched_tokens=64, cpu_kv_cache_space_gb=0.05, tensor_parallel_size=2,
                  distributed_timeout_s=60)
        outs = llm.generate([{"prompt_token_ids": p} for p in json.loads(sys.argv[2])],
                            SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
        with open(sys.argv[3], "w") as f:  # only rank 0 gets here
            json.dump([o.outputs[0].token_ids for o in outs], f)
        llm.shutdown()
''')
PROMPTS = [[3, 17, 29, 5, 88], [101, 7, 7, 42, 9, 13, 150, 2, 61]]
LAUNCH_ENV = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("torchrun_llama")
    _save_llama(directory, 2)
    return directory


def test_torchrun_two_ranks_equal_one_process(model_dir, tmp_path):
    script, out = tmp_path / "run.py", tmp_path / "tokens.json"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
                           "--nproc-per-node", "2", str(script), str(model_dir), json.dumps(PROMPTS), str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    single = make_llm(model_dir, 1)
    try:
        want = [o.outputs[0].token_ids for o in single.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], greedy_params(16))]
    finally:
        single.shutdown()
    assert json.loads(out.read_text()) == want


def test_launcher_variables(monkeypatch):
    for key in LAUNCH_ENV:
        monkeypatch.delenv(key, raising=False)
    assert ranks.launched_rank() is None
    for key, value in {**LAUNCH_ENV, "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(key, value)
    assert ranks.launched_rank() is None  # a world of one is not a launch of several
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert ranks.launched_rank() == ranks.LaunchedRank(3, 4, 1)


def test_a_launched_world_must_match_the_parallel_sizes(model_dir, monkeypatch):
    for key, value in LAUNCH_ENV.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match="started 2 processes .WORLD_SIZE. but .* make 1 ranks"):
        make_llm(model_dir, 1)


def test_serve_on_a_rank_above_zero_follows_and_binds_nothing(model_dir, monkeypatch):
    from armillary.server import cli as server_cli
    from armillary.server.cli import add_serve_args

    for key, value in {**LAUNCH_ENV, "RANK": "1", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(key, value)
    followed = []
    monkeypatch.setattr(ranks, "follow_rank_zero", lambda config, registry: followed.append(config))

    def no_bind(*_):
        raise AssertionError("a following rank must not bind the port")

    monkeypatch.setattr(server_cli, "bind_listening_socket", no_bind)
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args([str(model_dir), "--tp-size", "2", "--device", "cpu", "--port", "8123"])
    assert server_cli.run_serve(args) == 0
    assert len(followed) == 1 and followed[0].tensor_parallel_size == 2 and followed[0].model == str(model_dir)
