"""Tensor parallelism through the engine on the CPU (gloo, one process per rank): a tiny random Llama at TP = 2 and 4
gives the greedy tokens and logprobs of one process over 32 steps, with replicated key-value heads and a tied head over
an odd vocabulary (split by rows) too, and under forced preemption; each rank holds its shard; a rank killed mid-run
(of two or four) ends the engine with an error naming it, within the timeout; a model that does not shard is refused
naming the issue; a calibrated fp8 KV cache over two ranks equals one process; rank 0 copies only its shard out of
the files."""
from __future__ import annotations

import asyncio
import time

import pytest
import torch

import armillary_llama.hooks as llama_hooks
from armillary import LLM, SamplingParams
from armillary.registry import PluginRegistry
from armillary.worker.ranks import RankFailed, portable_plan

VOCAB = 160
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=3)


def _save_llama(directory, kv_heads: int, tied: bool = False, vocab: int = VOCAB) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(kv_heads)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=512,
                         initializer_range=0.08, tie_word_embeddings=tied)
    LlamaForCausalLM(config).eval().save_pretrained(directory)


# (kv heads, tied head, vocabulary): an even split; one replicated kv head with a tied head over an odd vocabulary
@pytest.fixture(scope="module", params=[(2, False, VOCAB), (1, True, VOCAB + 1)], ids=["kv2", "kv1-tied-odd-vocab"])
def model_dir(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"tp_llama_kv{request.param[0]}")
    _save_llama(directory, *request.param)
    return directory


def make_llm(model_dir, tp: int, **kw) -> LLM:
    registry = PluginRegistry()
    registry.register(llama_hooks, "llama", distribution="armillary-llama")  # the ranks rebuild it from its recipe
    args = dict(dtype="float32", device="cpu", max_model_len=256, block_size=8, max_num_seqs=8,
                max_num_batched_tokens=64, cpu_kv_cache_space_gb=0.05, tensor_parallel_size=tp,
                distributed_timeout_s=30)
    return LLM(str(model_dir), registry=registry, **{**args, **kw})


def prompts() -> list[dict]:
    g = torch.Generator().manual_seed(7)
    return [{"prompt_token_ids": torch.randint(0, VOCAB, (n,), generator=g).tolist()} for n in (5, 23, 9, 41)]


def run(llm: LLM) -> tuple[list[list[int]], list[list[float]]]:
    outs = llm.generate(prompts(), GREEDY)
    llm.engine.cache.check_accounting(list(llm.engine.scheduler.running))
    return [o.outputs[0].token_ids for o in outs], [[lp.logprob for lp in o.outputs[0].logprobs] for o in outs]


@pytest.fixture(scope="module")
def single(model_dir):
    llm = make_llm(model_dir, 1)
    yield run(llm)
    llm.engine.shutdown()


@pytest.mark.parametrize("tp", [2, 4])
def test_ranks_give_one_process_greedy_tokens_and_logprobs(model_dir, single, tp):
    """Two and four processes; at four, both key-value layouts have fewer kv heads than ranks (replicated)."""
    llm = make_llm(model_dir, tp)
    try:
        tokens, logprobs = run(llm)
        attn = llm.engine.model.model.layers[0].self_attn
        kv_total = 2 if "kv2" in str(model_dir) else 1
        assert (attn.num_heads, attn.num_kv_heads) == (4 // tp, max(1, kv_total // tp))  # rank 0 holds its share
        assert attn.qkv_proj.weight.shape[0] == (4 // tp + 2 * attn.num_kv_heads) * 16
        assert llm.engine.model.model.layers[0].mlp.down_proj.weight.shape == (64, 96 // tp)
        assert llm.engine.worker.caches[0].k.shape[-2] == attn.num_kv_heads  # the cache holds rank 0's heads
        vocab = llm.engine.model.args.vocab_size
        assert llm.engine.model.model.embed_tokens.weight.shape[0] == -(-vocab // tp)  # 1 / tp of the vocabulary
        assert len(llm.engine.worker.procs) == tp - 1  # ranks 1..tp-1 spawned
    finally:
        llm.engine.shutdown()
    assert tokens == single[0]
    for got, want in zip(logprobs, single[1]):
        assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-4)


def test_two_ranks_under_forced_preemption_equal_one_process(model_dir, single):
    llm = make_llm(model_dir, 2, num_kv_blocks=14)  # 4 sequences of up to 73 tokens cannot all hold their blocks
    try:
        tokens, _ = run(llm)
        assert llm.engine.scheduler.num_preemptions > 0
    finally:
        llm.engine.shutdown()
    assert tokens == single[0]


@pytest.mark.parametrize("tp,killed", [(2, 1), (4, 3)])
def test_a_killed_rank_ends_the_engine_with_an_error_naming_it(tmp_path, tp, killed):
    _save_llama(tmp_path, 2)
    llm = make_llm(tmp_path, tp, distributed_timeout_s=20)
    try:
        proc = llm.engine.worker.procs[killed - 1]
        proc.kill()
        proc.join(timeout=10)
        started = time.perf_counter()
        with pytest.raises(RankFailed, match=f"rank {killed} exited"):
            llm.generate(prompts(), GREEDY)
        assert time.perf_counter() - started < 20
    finally:
        llm.engine.shutdown()


def test_an_idle_server_engine_dies_when_a_rank_does(tmp_path):
    """No request in flight: the server's engine thread finds the dead rank on its idle health poll, so /health answers
    503 naming it and the server's on_dead exit runs, instead of waiting for the next request to fail."""
    from armillary.server.async_engine import HEALTH_POLL_S, AsyncEngine

    _save_llama(tmp_path, 2)
    llm = make_llm(tmp_path, 2, distributed_timeout_s=20)
    dead: list[BaseException] = []
    eng = AsyncEngine(lambda: llm.engine)
    loop = asyncio.new_event_loop()  # the server's loop, bound at its start-up; this test runs it by hand
    eng.start()
    try:
        eng.wait_until_loaded(timeout=10)
        assert eng.ready
        eng.bind_loop(loop)
        eng.on_dead = dead.append
        llm.engine.worker.procs[0].kill()
        deadline = time.monotonic() + 5 * HEALTH_POLL_S
        while eng.ready and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not eng.ready and "rank 1 exited" in eng.not_ready_reason()
        loop.run_until_complete(asyncio.sleep(0.1))  # run the posted callbacks
        assert len(dead) == 1 and isinstance(dead[0], RankFailed)
        assert llm.engine.worker.procs == []  # the other ranks stopped, the groups left
    finally:
        eng.shutdown(timeout=5)
        loop.close()
        llm.engine.shutdown()


def test_a_model_that_does_not_shard_is_refused_naming_the_issue(tmp_path, monkeypatch):
    from armillary_llama.model import LlamaForCausalLM

    _save_llama(tmp_path, 2)
    monkeypatch.setattr(LlamaForCausalLM, "supports_tensor_parallel", False)
    with pytest.raises(ValueError, match=r"does not shard its layers yet \(issue 20\)"):
        make_llm(tmp_path, 2)


def test_the_plan_travels_without_host_only_fields():
    from armillary.sequence import Sequence
    from armillary.step_plan import ScheduledChunk, StepPlan

    seq = Sequence("r", 0, [1, 2, 3], GREEDY, seed=3)
    seq.thinking, seq.block_tables, seq.state_slot = object(), [[4, 5]], 2
    plan = StepPlan([ScheduledChunk(seq, 0, 3, sample=True)], zero_slots=[2])
    sent = portable_plan(plan)
    copy = sent.chunks[0].seq
    assert copy is not seq and copy.thinking is None and copy.generator is None and copy.logprobs == []
    assert (copy.seq_id, copy.token_ids, copy.block_tables, copy.state_slot) == (seq.seq_id, [1, 2, 3], [[4, 5]], 2)
    assert sent.zero_slots == [2] and seq.thinking is not None  # the driver's sequence is untouched
    with pytest.raises(ValueError, match="still on the device"):
        portable_plan(StepPlan(plan.chunks, input_tokens=torch.zeros(1, dtype=torch.long)))


def test_an_fp8_kv_cache_over_two_ranks_equals_one_process(tmp_path):
    """Calibrated scales: each rank measures its own key-value heads and every rank takes the largest, so the two
    ranks quantize their caches as one process does and give its greedy tokens."""
    _save_llama(tmp_path, 2)
    fp8 = dict(kv_cache_dtype="fp8", kv_high_precision_layers="0", fp8_kv_calibration_tokens=48)
    results, scales = [], []
    for tp in (1, 2):
        llm = make_llm(tmp_path, tp, **fp8)
        try:
            results.append(run(llm))
            caches = [c for c in llm.engine.worker.caches if c is not None]
            assert all(c.k.dtype == torch.float8_e4m3fn for c in caches)
            scales.append([s for c in caches for s in (c.k_scale.item(), c.v_scale.item())])
        finally:
            llm.engine.shutdown()
    assert results[1][0] == results[0][0]
    assert len(scales[0]) == 4 and scales[1] == pytest.approx(scales[0], rel=1e-5)


def test_a_rank_copies_only_its_shard_out_of_the_files(tmp_path):
    """Rank 0 of two gets the checkpoint's tensors as LazySlice views and copies out exactly the bytes of its own
    parameters (its rows, columns and vocabulary rows; the norms and this Llama's replicated untied head whole)."""
    from armillary import shard_reads

    _save_llama(tmp_path, 2)
    total = sum(p.stat().st_size for p in tmp_path.glob("*.safetensors"))
    before = shard_reads.BYTES_READ[0]
    llm = make_llm(tmp_path, 2)
    try:
        read = shard_reads.BYTES_READ[0] - before
        held = sum(p.numel() * p.element_size() for p in llm.engine.model.parameters())
        assert read == held and read < 0.6 * total, (read, held, total)
        assert run(llm)[0] and not shard_reads._MAPS  # it runs, and the files are unmapped after the load
    finally:
        llm.engine.shutdown()
