"""Sampling through the engine: seeds, stop strings, stop tokens, logprobs, n; and bad input."""
from __future__ import annotations

import pytest
import torch

from armillary import LLM, SamplingParams
from armillary.errors import InvalidRequestError, ModelNotFoundError, PluginError
from plugins.qwen_gdn_moe.tests.harness import qwen_registry
from plugins.qwen_gdn_moe.tests.hf_models import CASES_BY_NAME, VOCAB, build_hf_model
from tests.fixtures.logits_recorder import LogitsRecorder
from tests.fixtures.tiny_tokenizer import make_qwen_tokenizer


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(request, tmp_path_factory):
    """The engine with and without async scheduling (next decode launched before tokens are read)."""
    path = tmp_path_factory.mktemp("tiny")
    build_hf_model(CASES_BY_NAME["next_full_last"]).save_pretrained(path)
    make_qwen_tokenizer(path, vocab_size=VOCAB)
    return LLM(str(path), registry=qwen_registry(), dtype="float32", max_model_len=96, max_num_seqs=8,
               async_scheduling=request.param)


def sample(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "max_tokens": 12, "ignore_eos": True, **kw})


def test_seeded_sampling_reproduces_across_batch_compositions(llm):
    alone = llm.generate("Hello world", sample(seed=7))[0].outputs[0].token_ids
    batch = llm.generate(["Some other prompt", "Hello world", "Hello world"],
                         [sample(seed=1), sample(seed=7), sample(seed=8)])
    assert batch[1].outputs[0].token_ids == alone
    assert batch[2].outputs[0].token_ids != alone
    unseeded = {tuple(o.outputs[0].token_ids) for o in llm.generate(["Hello world"] * 3, sample())}
    assert len(unseeded) > 1


def test_n_samples_are_distinct_and_reproducible(llm):
    a = llm.generate("Hello", sample(n=3, seed=11))[0]
    b = llm.generate("Hello", sample(n=3, seed=11))[0]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) == 3
    assert [o.index for o in a.outputs] == [0, 1, 2]


def test_stop_string_cuts_exactly(llm):
    full = llm.generate("The quick brown fox", sample(temperature=0.0, max_tokens=24))[0].outputs[0]
    text = full.text
    assert len(text) > 8
    stop = text[5:8]
    cut = llm.generate("The quick brown fox", sample(temperature=0.0, max_tokens=24, stop=[stop]))[0].outputs[0]
    assert cut.text == text[: text.index(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    kept = llm.generate("The quick brown fox", sample(temperature=0.0, max_tokens=24, stop=[stop],
                                                     include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == text[: text.index(stop) + len(stop)]


def test_stop_token_ids_and_length(llm):
    full = llm.generate([[5, 6, 7]], sample(temperature=0.0, max_tokens=10))[0].outputs[0]
    tok = full.token_ids[4]
    first = full.token_ids.index(tok)
    out = llm.generate([[5, 6, 7]], sample(temperature=0.0, max_tokens=10, stop_token_ids=[tok]))[0].outputs[0]
    assert out.token_ids == full.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == tok
    assert full.finish_reason == "length" and len(full.token_ids) == 10
    # the stop token's own text is not part of the output, even when special tokens are kept
    raw = llm.generate([[5, 6, 7]], sample(temperature=0.0, max_tokens=10, stop_token_ids=[tok],
                                           skip_special_tokens=False))[0].outputs[0]
    assert raw.text == llm.get_tokenizer().decode(raw.token_ids[:-1], skip_special_tokens=False)


def test_logprobs_equal_log_softmax_of_logits(llm):
    rec = LogitsRecorder(llm.engine.model)
    try:
        out = llm.generate([[9, 10, 11]], sample(logprobs=3, seed=3, max_tokens=6))[0].outputs[0]
    finally:
        rec.close()
    rows = rec.rows
    assert len(out.logprobs) == 6 and len(rows) == 6
    for row, lp, tok in zip(rows, out.logprobs, out.token_ids):
        ref = torch.log_softmax(row.float(), -1)
        assert lp.token_id == tok
        assert lp.logprob == pytest.approx(ref[tok].item(), abs=1e-5)
        top = torch.topk(ref, 3)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-5)


def test_bad_requests_are_clear_and_the_engine_keeps_serving(llm):
    engine = llm.engine
    engine.add_request("good", [1, 2, 3], sample(temperature=0.0, max_tokens=5))
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("empty", [], sample())
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        engine.add_request("long", [1] * 200, sample())
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        engine.add_request("long2", [1] * 90, sample(max_tokens=10))
    with pytest.raises(InvalidRequestError, match="token ids"):
        engine.add_request("oov", [1, 10 ** 6], sample())
    with pytest.raises(InvalidRequestError, match="temperature"):
        SamplingParams(temperature=-1)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outs] == ["good"] and len(outs[0].outputs[0].token_ids) == 5
    assert engine.stats()["kv_blocks_used"] == 0


def test_abort_frees_everything(llm):
    engine = llm.engine
    engine.add_request("a", [1, 2, 3, 4, 5], sample(max_tokens=50))
    engine.add_request("b", [1, 2], sample(max_tokens=50))
    engine.step()
    engine.step()
    assert engine.stats()["kv_blocks_used"] > 0
    engine.abort_request("a")
    engine.abort_request("b")
    engine.abort_request("never-existed")
    assert not engine.has_unfinished_requests()
    stats = engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["state_slots_used"] == 0


def test_unknown_model_directory(tmp_path):
    with pytest.raises(ModelNotFoundError) as err:
        LLM(str(tmp_path / "nope"), registry=qwen_registry())
    assert "nope" in str(err.value)


def test_architecture_no_plugin_serves(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["MysteryForCausalLM"], "model_type": "mystery"}')
    with pytest.raises(PluginError) as err:
        LLM(str(tmp_path), registry=qwen_registry())
    assert "MysteryForCausalLM" in str(err.value) and "Qwen3NextForCausalLM" in str(err.value)
