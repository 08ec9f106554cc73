"""Start-up warm-up on a tiny hybrid Qwen (GDN + attention, with tokenizer): every stage runs,
nothing stays held, and the warmed engine answers exactly as an unwarmed one (greedy, seeded and
unseeded sampling, prefix-cache counters); the prefill size plan; the persistent Triton cache
folder; start-up seconds in stats() and /metrics."""
from __future__ import annotations

import os

import pytest

import armillary.engine
import armillary.warmup as warmup
from armillary import LLM, SamplingParams
from armillary.worker import ModelWorker
from plugins.qwen_gdn_moe.tests.harness import qwen_registry
from tests.fixtures.tiny_models import save_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("warmup_tiny")
    save_tiny_model(path)
    return path


@pytest.fixture
def real_warm_up(monkeypatch):
    """The suite's conftest turns warm-up off; these tests turn it back on and record its reports
    (``sizes``: the prefill chunk lengths to warm, None for the device's default)."""
    calls = {"sizes": None, "reports": []}

    def record(engine):
        calls["reports"].append(warmup.warm_up(engine, sizes=calls["sizes"]))

    monkeypatch.setattr(armillary.engine, "warm_up", record)
    return calls


def _llm(model_dir, warm: bool, **kw) -> LLM:
    args = dict(dtype="float32", device="cpu", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32,
                enable_prefix_caching=True)
    return LLM(str(model_dir), registry=qwen_registry(), warmup=warm, **{**args, **kw})


def _answers(llm: LLM) -> list[list[int]]:
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13] * 15]
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True),  # the engine's shared stream
              SamplingParams(temperature=0.9, top_p=0.8, seed=3, max_tokens=6, ignore_eos=True)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts for _ in params], params * len(prompts))
    return [o.outputs[0].token_ids for o in outs]


def test_prefill_sizes_cover_every_bucket_both_ways():
    sizes = warmup.prefill_sizes(2048, 65535)
    assert sizes[0] == 1 and sizes[-1] == 2048
    for p in (2, 4, 8, 16, 32, 1024, 2048):
        assert p in sizes and p - 1 in sizes
    assert sizes == sorted(set(sizes))
    odd = warmup.prefill_sizes(100, 65535)
    assert max(odd) == 100 and 99 in odd and 64 in odd and 63 in odd
    assert max(warmup.prefill_sizes(16384, 300)) == 300  # the context limit caps the budget


def test_warm_up_runs_every_stage_and_frees_everything(model_dir, real_warm_up, monkeypatch):
    real_warm_up["sizes"] = sizes = warmup.prefill_sizes(32, 255)  # the GPU's plan at a 32-token budget
    steps = []  # (start, num_tokens) of every chunk, per launched step
    launch = ModelWorker.launch

    def spy(self, plan):
        steps.append([(c.start, c.num_tokens) for c in plan.chunks])
        return launch(self, plan)

    monkeypatch.setattr(ModelWorker, "launch", spy)
    warm = _llm(model_dir, warm=True)
    monkeypatch.setattr(ModelWorker, "launch", launch)
    for n in sizes:  # each size alone in its step, as a fresh prompt and over 32 cached tokens
        assert [(0, n)] in steps and [(32, n)] in steps, n
    assert any(len(s) == 2 and {t for _, t in s} != {1} and 1 in {t for _, t in s} for s in steps)  # decode + prefill
    (report,) = real_warm_up["reports"]
    names = [n for n, _ in report.stages]
    for n in (1, 3, 4, 7, 8, 15, 16, 31, 32):
        assert any(name.startswith("prefill ") and str(n) in name.split()[1].split("/") for name in names), names
        assert f"prefill {n} tokens after 32" in names, names
    assert {"mixed decode + prefill steps", "sampler paths", "chat template", "grammar mask (JSON schema)"} <= set(names)
    assert not report.skipped, report.skipped
    engine = warm.engine
    engine.cache.check_accounting()
    stats = engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_cached"] == 0 and stats["prefix_cache_prompt_tokens"] == 0
    assert stats["state_slots_used"] == 0 and stats["num_preemptions"] == 0 and stats["startup_seconds"] > 0
    assert len(engine.structured) == 0 and not engine.requests

    cold = _llm(model_dir, warm=False)
    assert _answers(warm) == _answers(cold)
    after_warm, after_cold = warm.engine.stats(), cold.engine.stats()
    after_warm.pop("startup_seconds"), after_cold.pop("startup_seconds")
    assert after_warm == after_cold


def test_default_cpu_warm_up_is_small_and_fits_tight_pools(model_dir, real_warm_up):
    llm = _llm(model_dir, warm=True, num_kv_blocks=2, max_num_seqs=1, enable_prefix_caching=False)  # 32 tokens
    (report,) = real_warm_up["reports"]
    names = [n for n, _ in report.stages]
    assert names[0] == "prefill 8 tokens"  # one small size on the CPU
    assert "prefill 8 tokens after 32" in report.skipped  # 40 tokens: more than the pool holds
    llm.engine.cache.check_accounting()
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))[0].outputs[0].token_ids


def test_warmup_flag_off_runs_nothing(model_dir, real_warm_up):
    _llm(model_dir, warm=False)
    assert real_warm_up["reports"] == []


def test_compile_cache_folder_is_stable_across_starts(model_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    first = _llm(model_dir, warm=False)
    folder = tmp_path / "xdg" / "armillary" / "triton"
    assert os.environ["TRITON_CACHE_DIR"] == str(folder) and folder.is_dir()
    import triton

    if hasattr(triton, "knobs"):  # Triton >= 3.4 reads the variable when it compiles
        assert triton.knobs.cache.dir == str(folder)
    del first
    _llm(model_dir, warm=False)  # a second start finds the same folder
    assert os.environ["TRITON_CACHE_DIR"] == str(folder)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    assert warmup.configure_compile_cache() == str(tmp_path / "mine")  # the user's choice wins


def test_startup_seconds_gauge():
    pytest.importorskip("prometheus_client")
    from armillary.server.metrics import _EngineCollector

    families = {f.name: f for f in _EngineCollector(lambda: {"startup_seconds": 12.5}).collect()}
    assert families["armillary_startup_seconds"].samples[0].value == 12.5
    assert "armillary_startup_seconds" not in {f.name for f in _EngineCollector(lambda: {}).collect()}
