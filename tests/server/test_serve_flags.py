"""``armillary serve``'s flags without a server: Atlas's aliases, help groups, refusals, budgets, mode defaults.

Also: unbuilt features (tensor / expert parallelism) refused before anything loads, and the
command when the server's packages are missing.
"""
from __future__ import annotations

import argparse
import builtins
import subprocess
import sys

import pytest

from armillary.server.errors import APIError
from armillary.server.flags import (
    add_serve_args,
    check_thinking_budget,
    engine_config,
    template_defaults,
)
from armillary.server.parsing import ParserSetup
from armillary.server.startup_checks import StartupError
from armillary.server.thinking import EFFORT_BUDGETS, mode_defaults, reply_thinking, requested_budget
from armillary.parsers.think import ThinkReasoningParser


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    return parser.parse_args(list(argv))


def test_atlas_names_are_aliases_of_ours():
    atlas = _parse("m", "--bind", "0.0.0.0", "--max-seq-len", "65536", "--max-prefill-tokens", "16384",
                   "--model-name", "qwen", "--num-drafts", "3", "--speculative", "--kv-cache-dtype", "fp8",
                   "--kv-high-precision-layers", "auto", "--ssm-checkpoint-interval", "512",
                   "--scheduling-policy", "slai", "--tbt-deadline-ms", "40", "--tp-size", "1", "--ep-size", "1")
    ours = _parse("m", "--host", "0.0.0.0", "--max-model-len", "65536", "--max-num-batched-tokens", "16384",
                  "--served-model-name", "qwen", "--num-drafts", "3", "--speculative", "--kv-cache-dtype", "fp8",
                  "--kv-high-precision-layers", "auto", "--state-checkpoint-interval", "512",
                  "--scheduling-policy", "slai", "--tbt-deadline-ms", "40", "--tensor-parallel-size", "1",
                  "--expert-parallel-size", "1")
    assert vars(atlas) == vars(ours)
    config = engine_config(atlas, "m")
    assert (config.max_model_len, config.max_num_batched_tokens) == (65536, 16384)
    assert config.state_checkpoint_interval == 512
    assert (config.scheduling_policy, config.tbt_deadline_ms, config.num_drafts) == ("slai", 40.0, 3)
    assert atlas.host == "0.0.0.0" and atlas.served_model_name == ["qwen"]
    config.validate()


def test_defaults_keep_the_engine_config_defaults():
    config = engine_config(_parse("m"), "m")
    default = type(config)("m")
    assert config.scheduling_policy == "fcfs" and config.max_num_batched_tokens == default.max_num_batched_tokens


def test_bad_scheduling_policy_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit):
        _parse("m", "--scheduling-policy", "edf")
    assert "fcfs" in capsys.readouterr().err


def test_help_groups_the_flags():
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    groups = {g.title: {a.dest for a in g._group_actions} for g in parser._action_groups}
    assert {"host", "port", "served_model_name"} <= groups["server"]
    assert {"max_model_len", "max_num_batched_tokens", "scheduling_policy", "tbt_deadline_ms"} <= \
        groups["memory and scheduling"]
    assert {"speculative", "num_drafts", "speculative_config"} <= groups["speculative decoding"]
    assert {"kv_cache_dtype", "kv_high_precision_layers"} <= groups["quantization"]
    assert {"disable_thinking", "max_thinking_budget", "default_chat_template_kwargs", "generation_config",
            "tool_call_parser"} <= groups["chat, tools and reasoning"]
    assert {"tensor_parallel_size", "expert_parallel_size"} <= groups["parallelism"]


def test_parallel_sizes_reach_the_engine_config():
    config = engine_config(_parse("m", "--tp-size", "2", "--ep-size", "2"), "m")
    assert (config.tensor_parallel_size, config.expert_parallel_size, config.world_size) == (2, 2, 2)
    assert engine_config(_parse("m", "--ep-size", "4"), "m").world_size == 4


def test_mismatched_parallel_sizes_fail_in_one_line_before_loading(tmp_path):
    result = subprocess.run([sys.executable, "-m", "armillary.cli", "serve", str(tmp_path / "nowhere"), "--port", "0",
                             "--tp-size", "2", "--ep-size", "3"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "--expert-parallel-size 3 must be 1, the --tensor-parallel-size (2" in result.stderr
    assert "Traceback" not in result.stderr and "loading" not in result.stderr


def test_disable_thinking_is_the_enable_thinking_false_template_default():
    assert template_defaults(_parse("m")) == {}
    assert template_defaults(_parse("m", "--disable-thinking")) == {"enable_thinking": False}
    both = _parse("m", "--disable-thinking", "--default-chat-template-kwargs", '{"x": 1}')
    assert template_defaults(both) == {"x": 1, "enable_thinking": False}
    with pytest.raises(StartupError, match="contradicts"):
        template_defaults(_parse("m", "--disable-thinking", "--default-chat-template-kwargs",
                                 '{"enable_thinking": true}'))
    with pytest.raises(SystemExit):
        _parse("m", "--max-thinking-budget", "-1")


def test_max_thinking_budget_needs_a_reasoning_parser_with_an_end_tag():
    check_thinking_budget(ParserSetup(), None)
    check_thinking_budget(ParserSetup(ThinkReasoningParser, None, "think"), 64)
    with pytest.raises(StartupError, match="--reasoning-parser NAME"):
        check_thinking_budget(ParserSetup(), 64)
    no_end = type("NoEnd", (ThinkReasoningParser,), {"end_tag": None})
    with pytest.raises(StartupError, match="no end tag"):
        check_thinking_budget(ParserSetup(no_end, None, "noend"), 64)


def test_requested_budget_order_and_bad_values():
    assert requested_budget({"thinking_budget": 16}, "high", 999) == 16
    assert requested_budget({}, "high", 999) == 999  # Anthropic's budget_tokens
    assert requested_budget({}, "low") == EFFORT_BUDGETS["low"]
    assert requested_budget({}, "max") is None and requested_budget({}) is None
    for bad in (-1, "16", True):
        with pytest.raises(APIError) as err:
            requested_budget({"thinking_budget": bad})
        assert err.value.status == 400


class _Engine:
    def __init__(self, generation_config: str = "auto") -> None:
        self.generation_defaults = {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 100}
        self.config = type("C", (), {"generation_config": generation_config})()
        self.arch = type("A", (), {"sampling_defaults": {
            "thinking": {"temperature": 0.6, "top_k": 20},
            "non_thinking": {"temperature": 0.7, "presence_penalty": 1.5},
            "non_thinking_tools": {"temperature": 0.3}}})()


def _state(cap: int | None = None, generation_config: str = "auto", reasoning=ThinkReasoningParser):
    from armillary.server.state import ServerState

    engine = type("E", (), {"engine": _Engine(generation_config)})()
    return ServerState(engine, ["m"], ParserSetup(reasoning, None, "think"), None, max_thinking_budget=cap)


def test_reply_thinking_budget_cap_and_mode_defaults():
    open_prompt, closed_prompt = "user\n<think>\n", "user\n<think>\n\n</think>\n\n"
    state = _state(cap=64)
    reply = reply_thinking(state, open_prompt, None, {"thinking_budget": 16})
    assert (reply.thinking_budget, reply.thinking_end) == (16, "</think>")
    assert reply.sampling_defaults == {"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 100, "top_k": 20}
    assert reply_thinking(state, open_prompt, None, {"thinking_budget": 1000}).thinking_budget == 64  # the cap
    assert reply_thinking(state, open_prompt, None, {}).thinking_budget == 64  # the server's default
    assert reply_thinking(_state(), open_prompt, None, {}, "low").thinking_budget == EFFORT_BUDGETS["low"]
    assert reply_thinking(_state(), open_prompt, None, {}, None, 99).thinking_budget == 99  # Anthropic's
    off = reply_thinking(state, closed_prompt, None, {"thinking_budget": 16})
    assert off.fields() == {} and off.sampling_defaults["presence_penalty"] == 1.5  # thinking off: no budget
    assert reply_thinking(state, closed_prompt, [{"type": "function"}], {}).sampling_defaults["temperature"] == 0.3
    assert reply_thinking(_state(), open_prompt, None, {}).fields() == {}
    plain = reply_thinking(_state(generation_config="vllm"), open_prompt, None, {})
    assert plain.sampling_defaults["temperature"] == 1.0  # --generation-config vllm: no mode defaults either
    no_parser = _state(reasoning=None)
    assert reply_thinking(no_parser, open_prompt, None, {}, "high").fields() == {}  # an effort changes nothing
    with pytest.raises(APIError) as err:
        reply_thinking(no_parser, open_prompt, None, {"thinking_budget": 16})
    assert err.value.status == 400


def test_mode_defaults_fall_back_from_tools_to_the_mode():
    modes = {"thinking": {"temperature": 0.6}}
    assert mode_defaults(modes, True, True) == {"temperature": 0.6}
    assert mode_defaults(modes, False, False) == {}


def test_serve_without_the_server_packages_names_the_problem(monkeypatch, capsys):
    from armillary import cli

    real_import = builtins.__import__

    def no_server(name, *args, **kwargs):
        if name == "armillary.server.cli":
            raise ImportError("No module named 'uvicorn'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_server)
    assert cli.main(["serve", "--port", "8000"]) == 1
    err = capsys.readouterr().err
    assert "uvicorn" in err and "reinstall" in err and "unrecognized arguments" not in err


def test_server_packages_are_core_dependencies():
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    names = {dep.split(">")[0].split("=")[0].strip() for dep in project["dependencies"]}
    assert {"fastapi", "uvicorn", "prometheus_client", "pydantic", "starlette"} <= names
    assert project["optional-dependencies"]["server"] == []  # kept as an alias: ".[server]" still installs
