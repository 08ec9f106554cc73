"""Speculative verification with penalties and min_tokens: per-row draft counts, greedy speculation equals none, sampled rows keep the distribution.

Row i of a sequence counts the drafts before it, so greedy rows are exact (speculation on = off),
sampled rows keep the target distribution (chi-square), and such sequences accept drafts; through
the engine on a tiny Qwen3-Next with an MTP head and an oracle drafter, K = 1, 2, 3.
"""
from __future__ import annotations

import pytest
import torch

from armillary.sampler import Sampler, apply_penalties, mask_stop_tokens_before_min
from armillary.sampling_params import SamplingParams
from armillary.speculative.verify import drafts_before_rows, verify_drafts
from plugins.qwen_gdn_moe.tests.harness import build_engine
from plugins.qwen_gdn_moe.tests.hf_models import CASES_BY_NAME, VOCAB, prompts
from plugins.qwen_gdn_moe.tests.mtp_checkpoint import save_with_mtp
from tests.fixtures.engine_runs import run_to_completion
from tests.fixtures.penalties import KINDS
from tests.fixtures.penalties import seq_with_output as _seq
from tests.fixtures.oracle_drafts import use_oracle_drafts


@pytest.mark.parametrize("vocab", [7, 33, 101])
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("k", [1, 3])
def test_verify_rows_penalised_as_if_the_drafts_were_appended(vocab, kind, k):
    gen = torch.Generator().manual_seed(vocab + k)
    histories = [([1, 2], [3, 3, 0]), ([vocab - 1], []), ([4], [vocab - 1, 5])]
    seqs = [_seq([t % vocab for t in p], [t % vocab for t in o], **KINDS[kind]) for p, o in histories]
    seqs.append(_seq([1], [2], temperature=0.5))  # no penalty: its rows untouched
    drafts = torch.randint(0, vocab, (len(seqs), k), generator=gen)
    drafts[0, 0] = 3  # a draft already in the history, and one repeated within the drafts
    drafts[1, -1] = drafts[1, 0]
    logits = torch.randn(len(seqs) * (k + 1), vocab, generator=gen) * 3  # [B(K+1), V]
    got = apply_penalties(logits, seqs, drafts_before_rows(drafts))
    for b, seq in enumerate(seqs):
        for i in range(k + 1):
            row = b * (k + 1) + i
            appended = _seq(seq.prompt_token_ids, seq.output_token_ids + drafts[b, :i].tolist(), **KINDS[kind])
            appended.params = seq.params
            assert torch.equal(got[row], apply_penalties(logits[row:row + 1], [appended])[0]), (b, i)
    assert torch.equal(got[-(k + 1):], logits[-(k + 1):])


def test_verify_rows_count_drafts_towards_min_tokens():
    k, vocab, eos = 3, 9, 2
    seqs = [_seq([5], [1], eos=(eos,), min_tokens=3), _seq([5], [1] * 3, eos=(eos,), min_tokens=3)]
    masked = mask_stop_tokens_before_min(torch.zeros(len(seqs) * (k + 1), vocab), seqs)
    # sequence 0 has 1 output token: rows 0 and 1 (1 and 2 tokens before them) still masked
    assert torch.isinf(masked[:, eos]).tolist() == [True, True, False, False] + [False] * 4


def test_greedy_verify_rejects_a_draft_its_penalised_row_would_not_pick():
    row = torch.tensor([0.0, 4.0, 0.0, 5.0, 0.0])  # a vocabulary of 5: token 3 first, then 1
    logits = row.repeat(3, 1)  # [K+1 = 3, V]
    seq = _seq([0], [], temperature=0.0, presence_penalty=1.5)
    out = verify_drafts(logits, [seq], torch.tensor([[3, 3]]), torch.tensor([2]), Sampler(seed=0))
    # row 1 sees d_1 = 3: 5 - 1.5 < 4, so it picks 1 and rejects d_2 = 3
    assert out.num_accepted.tolist() == [1] and out.tokens[0, :2].tolist() == [3, 1]


def _chi2_ok(counts: torch.Tensor, probs: torch.Tensor) -> bool:
    """Pearson's chi-square against ``probs`` below the 99.9% quantile for V - 1 = 4 degrees of freedom."""
    expected = probs * counts.sum()
    stat = ((counts - expected) ** 2 / expected.clamp_min(1e-9)).sum().item()
    return stat < 18.47


def test_rejection_sampling_with_penalties_keeps_the_target_distribution():
    """K = 2, presence and frequency penalties: given d_1 accepted, the second token follows p_1
    penalised with d_1 counted; given both, the bonus follows p_2 with both counted."""
    n, k, vocab = 40000, 2, 5
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(k + 1, vocab, generator=gen) * 1.5  # [K+1, V] the same for every sequence
    params = dict(temperature=0.9, presence_penalty=0.8, frequency_penalty=0.4)
    seqs = [_seq([1], [4], **params) for _ in range(n)]
    d = [3, 3]
    out = verify_drafts(rows.repeat(n, 1), seqs, torch.tensor([d]).repeat(n, 1), torch.full((n,), k), Sampler(seed=1))
    probs = torch.stack([Sampler.filtered(apply_penalties(rows[i:i + 1], [_seq([1], [4] + d[:i], **params)]),
                                          seqs[:1]).softmax(dim=-1)[0] for i in range(k + 1)])  # [K+1, V]
    tokens, acc = out.tokens, out.num_accepted
    assert _chi2_ok(torch.bincount(tokens[:, 0], minlength=vocab).float(), probs[0])
    first = acc >= 1
    assert first.float().mean().item() == pytest.approx(probs[0, 3].item(), abs=0.01)
    assert _chi2_ok(torch.bincount(tokens[first, 1], minlength=vocab).float(), probs[1])
    both = acc == 2
    assert both.float().mean().item() == pytest.approx((probs[0, 3] * probs[1, 3]).item(), abs=0.01)
    assert _chi2_ok(torch.bincount(tokens[both, 2], minlength=vocab).float(), probs[2])


# ---- through the engine

@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    return save_with_mtp(CASES_BY_NAME["next_full_last"], tmp_path_factory.mktemp("spec_pen"))


MIN_TOKENS_PROMPTS = ([30, 31, 32], [40, 41])


def _work(free: list[list[int]]) -> list[tuple[list[int], SamplingParams]]:
    """Distinct prompts (the oracle drafter looks them up): each penalty kind; min_tokens 6 holding back
    a stop token (the second of ``free[0]``, the greedy output of the first ``MIN_TOKENS_PROMPTS``), and
    min_tokens m letting one end the output at the first position allowed (``free[1][m]``, new there)."""
    ps = [p[:12] for p in prompts()] + [[7, 8, 9], *MIN_TOKENS_PROMPTS]
    base = dict(temperature=0.0, max_tokens=16, ignore_eos=True)
    params = [SamplingParams(presence_penalty=1.5, **base), SamplingParams(presence_penalty=-2.0, **base),
              SamplingParams(frequency_penalty=-1.5, **base), SamplingParams(repetition_penalty=0.3, **base),
              SamplingParams(presence_penalty=1.0, frequency_penalty=-1.0, repetition_penalty=0.5, **base)]
    params.append(SamplingParams(temperature=0.0, max_tokens=16, min_tokens=6, stop_token_ids=[free[0][1]]))
    m = next(i for i in range(4, len(free[1])) if free[1][i] not in free[1][:i])
    params.append(SamplingParams(temperature=0.0, max_tokens=16, min_tokens=m, stop_token_ids=[free[1][m]]))
    return list(zip(ps, params))


@pytest.mark.parametrize("k", [1, 2, 3])
def test_speculation_with_penalties_equals_no_speculation_and_accepts(mtp_dir, k):
    plain = build_engine(mtp_dir, block_size=8, num_kv_blocks=128, max_num_seqs=8)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    free = run_to_completion(plain, [(p, greedy) for p in MIN_TOKENS_PROMPTS])
    work = _work(free)
    ps = [p for p, _ in work]
    base = run_to_completion(plain, work)
    assert free[0][1] not in base[-2][:6] and len(base[-2]) >= 7  # min_tokens held the stop token back
    assert base[-1] == free[1][:work[-1][1].min_tokens + 1]  # and let it end the output right after
    engine = build_engine(mtp_dir, block_size=8, num_kv_blocks=128, max_num_seqs=8, speculative=True, num_drafts=k)
    accepted = use_oracle_drafts(engine, ps, base, VOCAB)
    assert run_to_completion(engine, work) == base
    assert set(accepted) == set(range(k + 1)), accepted  # every accepted length, up to K, happened
    assert engine.stats()["spec_tokens_per_step"] > 1.0
    engine.cache.check_accounting([])
