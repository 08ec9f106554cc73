"""Penalties and min_tokens with the latest token still on the device; async scheduling stays on with them.

The sampler counts a ``pending`` token exactly as if it were appended to the host history (every
penalty kind, odd vocab sizes), and the engine with async scheduling launches continuations for such
requests and gives the synchronous engine's tokens, on a tiny Qwen3-Next.
"""
from __future__ import annotations

import pytest
import torch

from armillary.sampler import Sampler, apply_penalties, mask_stop_tokens_before_min
from armillary.sampling_params import SamplingParams
from armillary.sequence import Sequence
from plugins.qwen_gdn_moe.tests.harness import build_engine
from plugins.qwen_gdn_moe.tests.hf_models import CASES_BY_NAME, build_hf_model, prompts
from tests.fixtures.engine_runs import run_to_completion
from tests.fixtures.penalties import KINDS
from tests.fixtures.penalties import seq_with_output as _seq


def _batch(vocab: int, kind: dict, seed: int) -> tuple[list[Sequence], list[Sequence], torch.Tensor]:
    """Five sequences (the fourth without penalties, the last with no output yet), their pending
    tokens [5], and the same sequences with the pending token appended on the host."""
    gen = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    shapes = [(3, 4, kind), (1, 9, kind), (6, 1, kind), (2, 5, {}), (4, 0, kind)]
    pending = torch.randint(0, vocab, (len(shapes),), generator=gen)
    pending[1] = 0  # id 0 and the last id: the edges of the count rows
    pending[2] = vocab - 1
    host, appended = [], []
    for (n_prompt, n_out, params), token in zip(shapes, pending.tolist()):
        prompt, output = ids(n_prompt), ids(n_out)
        if n_out:
            output[0] = token  # a pending token seen before: its count goes to 2
        host.append(_seq(prompt, output, **params))
        appended.append(_seq(prompt, output + [token], **params))
    return host, appended, pending


@pytest.mark.parametrize("vocab", [7, 33, 101])
@pytest.mark.parametrize("kind", list(KINDS))
def test_pending_token_penalised_as_if_appended(vocab, kind):
    host, appended, pending = _batch(vocab, KINDS[kind], seed=vocab)
    logits = torch.randn(len(host), vocab, generator=torch.Generator().manual_seed(1)) * 3
    got = apply_penalties(logits, host, pending[:, None])
    want = apply_penalties(logits, appended)
    assert torch.equal(got, want)
    assert not torch.equal(got, apply_penalties(logits, host))  # the pending token matters
    assert torch.equal(got[3], logits[3])  # no penalty: untouched


@pytest.mark.parametrize("vocab", [7, 33])
def test_pending_token_counts_towards_min_tokens(vocab):
    eos, stop = 2, vocab - 1
    outputs = [[], [1], [1, 1], [1, 1, 1]]  # with the pending token: 1, 2, 3, 4 output tokens
    host = [_seq([5], out, eos=(eos,), min_tokens=3, stop_token_ids=[stop]) for out in outputs]
    appended = [_seq([5], out + [4], eos=(eos,), min_tokens=3, stop_token_ids=[stop]) for out in outputs]
    logits = torch.zeros(len(host), vocab)
    got = mask_stop_tokens_before_min(logits, host, ahead=1)
    assert torch.equal(got, mask_stop_tokens_before_min(logits, appended))
    assert torch.isinf(got[:2, [eos, stop]]).all() and not torch.isinf(got[2:]).any()


@pytest.mark.parametrize("kind", list(KINDS))
def test_sampler_with_pending_equals_sampler_on_the_appended_history(kind):
    vocab = 33
    host, appended, pending = _batch(vocab, {**KINDS[kind], "temperature": 0.0}, seed=5)
    logits = torch.randn(len(host), vocab, generator=torch.Generator().manual_seed(2)) * 2
    got = Sampler(seed=0)(logits, host, pending=pending).token_ids
    assert torch.equal(got, Sampler(seed=0)(logits, appended).token_ids)


# ---- through the engine

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("pen_async")
    build_hf_model(CASES_BY_NAME["next_full_last"]).save_pretrained(path)
    return path


# negative penalties make a tiny random model repeat itself: every token then depends on the counts
ENGINE_KINDS = [dict(presence_penalty=1.5), dict(presence_penalty=-2.0), dict(frequency_penalty=-1.5),
                dict(repetition_penalty=0.3), dict(presence_penalty=1.0, frequency_penalty=-1.0, repetition_penalty=0.5)]


MIN_TOKENS_PROMPT = [30, 31, 32]


def _work(free: list[int]) -> list[tuple[list[int], SamplingParams]]:
    """Greedy with each penalty kind, a seeded sampled one; and min_tokens 6 holding back a stop token
    (the second token of ``free``, the greedy output of ``MIN_TOKENS_PROMPT``) or letting it end the
    output at the first position allowed (``free[m]``, first seen there)."""
    ps = [p[:12] for p in prompts()] + [[7, 8, 9], [11, 12, 13, 14], [20, 21], MIN_TOKENS_PROMPT]
    base = dict(max_tokens=14, ignore_eos=True)
    params = [SamplingParams(temperature=0.0, **kind, **base) for kind in ENGINE_KINDS]
    params.append(SamplingParams(temperature=0.8, seed=3, presence_penalty=1.5, **base))
    params.append(SamplingParams(temperature=0.0, max_tokens=14, min_tokens=6, stop_token_ids=[free[1]]))
    m = next(i for i in range(4, len(free)) if free[i] not in free[:i])
    ps.append(MIN_TOKENS_PROMPT)
    params.append(SamplingParams(temperature=0.0, max_tokens=14, min_tokens=m, stop_token_ids=[free[m]]))
    return list(zip(ps, params))


def test_async_scheduling_with_penalties_equals_sync(model_dir):
    probe = build_engine(model_dir, block_size=8, num_kv_blocks=96, max_num_seqs=8, async_scheduling=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    free = run_to_completion(probe, [(MIN_TOKENS_PROMPT, greedy)])[0]
    work = _work(free)
    sync = run_to_completion(probe, work)
    assert free[1] not in sync[-2][:6] and len(sync[-2]) >= 7  # min_tokens held the stop token back
    assert sync[-1] == free[:work[-1][1].min_tokens + 1]  # and let it end the output right after
    plain = run_to_completion(probe, [(p, greedy) for p, _ in work[:5]])
    assert all(a != b for a, b in zip(sync[1:5], plain[1:5]))  # the penalties changed the output
    engine = build_engine(model_dir, block_size=8, num_kv_blocks=96, max_num_seqs=8, async_scheduling=True)
    assert run_to_completion(engine, work) == sync
    assert engine.num_async_steps > 0
    before = engine.num_async_steps
    alone = run_to_completion(engine, work[:1])  # one penalised sequence alone continues every step
    assert alone == sync[:1] and engine.num_async_steps - before >= 12
    engine.cache.check_accounting([])
