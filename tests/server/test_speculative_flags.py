"""Speculation's server surface: Atlas's and vLLM's flags map onto the engine config, bad ones
are refused before loading, and /metrics carries the acceptance figures."""
from __future__ import annotations

import argparse

import pytest

from armillary.server.cli import add_serve_args, engine_config
from armillary.server.metrics import ServerMetrics


def _config(argv: list[str]):
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    return engine_config(parser.parse_args(argv), "some/model")


def test_atlas_and_vllm_spellings_give_the_same_config():
    atlas = _config(["--speculative", "--num-drafts", "3"])
    vllm = _config(["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 3}'])
    assert (atlas.speculative, atlas.num_drafts) == (vllm.speculative, vllm.num_drafts) == (True, 3)
    assert _config([]).speculative is False


@pytest.mark.parametrize("value,message", [
    ('{"method": "ngram", "num_speculative_tokens": 2}', "not supported"),
    ('{"method": "mtp", "prompt_lookup_max": 4}', "unsupported --speculative-config keys"),
])
def test_unsupported_speculative_configs_are_refused(value, message):
    with pytest.raises(ValueError, match=message):
        _config(["--speculative-config", value])


def test_num_drafts_out_of_range_is_refused():
    config = _config(["--speculative", "--num-drafts", "4"])
    with pytest.raises(ValueError, match="num_drafts must be 1, 2 or 3"):
        config.validate()


def test_metrics_report_acceptance_when_speculating():
    stats = {"spec_acceptance_rate": 0.5, "spec_mean_accepted_length": 1.0, "spec_tokens_per_step": 2.0,
             "num_draft_tokens": 8, "num_accepted_tokens": 4}
    text = ServerMetrics(lambda: stats).render().decode()
    for name, value in (("acceptance_rate", 0.5), ("mean_accepted_length", 1.0), ("tokens_per_step", 2.0),
                        ("num_draft_tokens", 8.0), ("num_accepted_tokens", 4.0)):
        assert f"armillary_spec_decode_{name} {value}" in text
    assert "armillary_spec_decode" not in ServerMetrics(lambda: {}).render().decode()
