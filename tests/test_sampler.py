"""Sampler: greedy, filters, penalties, min_tokens, seeds, logprobs and the sampled distribution."""
from __future__ import annotations

import math

import pytest
import torch

from armillary.sampler import Sampler, apply_penalties, apply_top_k_top_p_min_p, mask_stop_tokens_before_min
from armillary.sampling_params import SamplingParams
from armillary.sequence import Sequence

# CUDA joins the parametrisation only where it exists, so no case is ever skipped
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def make_seq(prompt: list[int] | None = None, output: list[int] | None = None, eos: tuple[int, ...] = (),
             seed: int | None = None, **params) -> Sequence:
    seq = Sequence("req", 0, prompt or [0], SamplingParams(**params), eos_token_ids=eos, seed=seed)
    seq.token_ids.extend(output or [])
    return seq


def random_logits(rows: int, vocab: int, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=generator) * 3).to(device)


def kept(row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(row)).flatten().tolist())


def expected_kept(logits: list[float], top_k: int, top_p: float, min_p: float) -> set[int]:
    """Direct per-row filtering in plain Python, the oracle for ``apply_top_k_top_p_min_p``."""
    order = sorted(range(len(logits)), key=lambda i: -logits[i])
    if top_k > 0:
        order = order[:top_k]

    def probs_of(ids: list[int]) -> list[float]:
        total = sum(math.exp(logits[i] - logits[ids[0]]) for i in ids)
        return [math.exp(logits[i] - logits[ids[0]]) / total for i in ids]

    keep, mass = [], 0.0
    for token, prob in zip(order, probs_of(order)):
        if keep and mass >= top_p:
            break
        keep.append(token)
        mass += prob
    probs = probs_of(keep)
    return {t for t, p in zip(keep, probs) if p >= min_p * probs[0]}


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax_and_input_untouched(device):
    logits = random_logits(5, 40, device=device)
    before = logits.clone()
    seqs = [make_seq(temperature=0.0, top_k=3, top_p=0.5) for _ in range(5)]
    out = Sampler(seed=0)(logits, seqs)
    assert out.token_ids.dtype == torch.int64 and out.token_ids.device == logits.device
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))
    assert torch.equal(logits, before)
    assert out.logprobs is None and out.top_ids is None and out.top_logprobs is None


def test_top_k_keeps_exactly_k():
    logits = random_logits(4, 30, seed=1)
    ks = [1, 5, 29, 30]
    filtered = apply_top_k_top_p_min_p(logits, torch.tensor(ks), None, None)
    for row, k in enumerate(ks):
        assert kept(filtered[row]) == set(logits[row].topk(k).indices.tolist())
        assert torch.equal(filtered[row][torch.isfinite(filtered[row])], logits[row][torch.isfinite(filtered[row])])


def test_top_p_boundary():
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])  # sorted: token 1 (0.5), 3 (0.3), 0 (0.15), 2 (0.05)
    logits = probs.log().repeat(4, 1)
    top_p = torch.tensor([0.1, 0.79, 0.81, 0.96])
    filtered = apply_top_k_top_p_min_p(logits, None, top_p, None)
    assert [kept(row) for row in filtered] == [{1}, {1, 3}, {0, 1, 3}, {0, 1, 2, 3}]


def test_min_p_relative_to_max():
    probs = torch.tensor([0.1, 0.4, 0.3, 0.2])
    logits = probs.log().repeat(3, 1)
    filtered = apply_top_k_top_p_min_p(logits, None, None, torch.tensor([0.0, 0.6, 0.9]))
    assert [kept(row) for row in filtered] == [{0, 1, 2, 3}, {1, 2}, {1}]


def test_combined_filters_match_direct_computation():
    vocab = 12
    logits = random_logits(24, vocab, seed=2)
    cases = [(k, p, m) for k in (0, 1, 4, 9) for p in (1.0, 0.6, 0.9) for m in (0.0, 0.3)]
    top_k = torch.tensor([k if k else vocab for k, _, _ in cases])
    top_p = torch.tensor([p for _, p, _ in cases])
    min_p = torch.tensor([m for _, _, m in cases])
    filtered = apply_top_k_top_p_min_p(logits, top_k, top_p, min_p)
    for row, (k, p, m) in enumerate(cases):
        assert kept(filtered[row]) == expected_kept(logits[row].tolist(), k, p, m), (k, p, m)


def test_penalties_follow_vllm_formulas():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0, 1.0],
                           [2.0, -1.0, 0.5, -0.5, 3.0, 1.0]])
    prompt, output = [1, 4], [2, 3, 3]
    seqs = [make_seq(prompt, output, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
            make_seq(prompt, output)]  # no penalties: row unchanged
    # by hand: seen = {1, 2, 3, 4}; positive seen logits halve, negative ones double; then
    # token 2 (count 1): -0.5 - 0.25; token 3 (count 2): -2*0.5 - 0.25
    expected = torch.tensor([2.0, -2.0, 0.25 - 0.75, -1.0 - 1.25, 1.5, 1.0])
    penalised = apply_penalties(logits, seqs)
    assert torch.allclose(penalised[0], expected)
    assert torch.equal(penalised[1], logits[1])


def test_repetition_penalty_alone_counts_prompt_and_output():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    seqs = [make_seq([0], [2], repetition_penalty=4.0)]
    assert torch.allclose(apply_penalties(logits, seqs), torch.tensor([[0.25, 1.0, 0.25, 1.0]]))
    frequency_only = [make_seq([0], [2, 2], frequency_penalty=1.0)]  # prompt tokens not counted
    assert torch.allclose(apply_penalties(logits, frequency_only), torch.tensor([[1.0, 1.0, -1.0, 1.0]]))


@pytest.mark.parametrize("device", DEVICES)
def test_penalties_change_greedy_choice(device):
    logits = torch.tensor([[5.0, 4.0, 0.0]], device=device)
    plain = Sampler(seed=0)(logits, [make_seq([7], [0], temperature=0.0)])
    penalised = Sampler(seed=0)(logits, [make_seq([7], [0], temperature=0.0, presence_penalty=1.5)])
    assert plain.token_ids.tolist() == [0] and penalised.token_ids.tolist() == [1]


def test_min_tokens_masks_eos_and_stop_ids():
    vocab, eos, stop = 8, 5, 6
    logits = torch.zeros(4, vocab)
    seqs = [make_seq(output=[1], eos=(eos,), min_tokens=3, stop_token_ids=[stop]),
            make_seq(output=[1], eos=(eos,), min_tokens=3, stop_token_ids=[stop], ignore_eos=True),
            make_seq(output=[1, 2, 3], eos=(eos,), min_tokens=3, stop_token_ids=[stop]),  # reached
            make_seq(output=[], eos=(eos, 99), min_tokens=1)]  # 99 is beyond the vocab
    masked = mask_stop_tokens_before_min(logits, seqs)
    assert [sorted(set(range(vocab)) - kept(row)) for row in masked] == [[eos, stop], [stop], [], [eos]]
    assert torch.equal(logits, torch.zeros(4, vocab))


@pytest.mark.parametrize("device", DEVICES)
def test_min_tokens_steers_greedy_away_from_eos(device):
    logits = torch.tensor([[0.0, 1.0, 9.0], [0.0, 1.0, 9.0]], device=device)
    seqs = [make_seq(eos=(2,), temperature=0.0, min_tokens=1), make_seq(eos=(2,), temperature=0.0)]
    assert Sampler(seed=0)(logits, seqs).token_ids.tolist() == [1, 2]


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_rows_independent_of_batch(device):
    vocab, steps = 50, 6
    logits = [random_logits(1, vocab, seed=10 + s, device=device) for s in range(steps)]
    params = dict(temperature=1.3, top_k=20, top_p=0.95)

    def run(batch_before: int, batch_after: int, sampler_seed: int) -> list[int]:
        sampler = Sampler(seed=sampler_seed)
        target = make_seq(seed=1234, **params)
        others = [make_seq(seed=None if i % 2 else 99 + i, **params) for i in range(batch_before + batch_after)]
        tokens = []
        for step in range(steps):
            seqs = others[:batch_before] + [target] + others[batch_before:]
            rows = torch.cat([random_logits(batch_before, vocab, seed=step, device=device), logits[step],
                              random_logits(batch_after, vocab, seed=100 + step, device=device)])
            tokens.append(sampler(rows, seqs).token_ids[batch_before].item())
        return tokens

    alone = run(0, 0, sampler_seed=0)
    assert run(3, 2, sampler_seed=1) == alone
    assert run(0, 4, sampler_seed=2) == alone
    assert len(set(alone)) > 1


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_rows_do_not_consume_shared_generator(device):
    logits = random_logits(1, 64, seed=3, device=device)
    solo, mixed = Sampler(seed=7), Sampler(seed=7)
    for _ in range(5):
        a = solo(logits, [make_seq()]).token_ids.item()
        b = mixed(torch.cat([logits, logits]), [make_seq(seed=5), make_seq()]).token_ids[1].item()
        assert a == b


@pytest.mark.parametrize("device", DEVICES)
def test_unseeded_rows_differ(device):
    logits = torch.zeros(8, 1000, device=device)
    tokens = Sampler()(logits, [make_seq() for _ in range(8)]).token_ids.tolist()
    assert len(set(tokens)) > 1
    same_seed = Sampler(seed=0)(logits, [make_seq(seed=3) for _ in range(8)]).token_ids.tolist()
    assert len(set(same_seed)) == 1


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_raw_and_top_ids_are_topk(device):
    logits = random_logits(3, 20, seed=4, device=device)
    seqs = [make_seq([1], [2, 2], logprobs=2, temperature=0.7, repetition_penalty=1.5),
            make_seq(logprobs=5, temperature=0.0, frequency_penalty=1.0),
            make_seq(temperature=0.9)]  # did not ask: still gets rows, the runner trims them
    out = Sampler(seed=0)(logits, seqs)
    raw = logits.log_softmax(dim=-1)
    assert out.top_ids.shape == (3, 5) and out.top_logprobs.dtype == torch.float32
    assert torch.allclose(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))
    assert torch.equal(out.top_ids, raw.topk(5).indices)
    assert torch.allclose(out.top_logprobs, raw.topk(5).values)


def test_logprobs_zero_gives_sampled_logprob_only():
    logits = random_logits(2, 10, seed=5)
    out = Sampler(seed=0)(logits, [make_seq(logprobs=0), make_seq()])
    assert out.top_ids.shape == (2, 0) and out.top_logprobs.shape == (2, 0)
    assert torch.allclose(out.logprobs, logits.log_softmax(-1).gather(1, out.token_ids[:, None]).squeeze(1))


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    support = expected > 0
    assert counts[~support].sum() == 0, "sampled a filtered-out token"
    return float(((counts[support] - expected[support]) ** 2 / expected[support]).sum())


@pytest.mark.parametrize("device", DEVICES)
def test_sampled_distribution_matches_softmax(device):
    draws, temperature = 4000, 0.7
    base = torch.tensor([1.0, 0.2, -0.5, 0.6, -1.5])
    logits = base.repeat(draws, 1).to(device)
    tokens = Sampler(seed=0)(logits, [make_seq(temperature=temperature) for _ in range(draws)]).token_ids
    # 18.47 is the 0.999 quantile of chi-square with 4 degrees of freedom
    assert chi_square(tokens.cpu(), (base / temperature).softmax(-1)) < 18.47
    seeded = [make_seq(seed=s, temperature=temperature) for s in range(2000)]
    tokens = Sampler(seed=0)(logits[:2000], seeded).token_ids
    assert chi_square(tokens.cpu(), (base / temperature).softmax(-1)) < 18.47


@pytest.mark.parametrize("device", DEVICES)
def test_sampled_distribution_after_filters(device):
    draws = 4000
    base = torch.tensor([2.0, 1.5, 1.2, 0.3, 0.0, -1.0])
    logits = base.repeat(draws, 1).to(device)
    tokens = Sampler(seed=1)(logits, [make_seq(top_k=4, top_p=0.8) for _ in range(draws)]).token_ids
    kept_ids = sorted(expected_kept(base.tolist(), 4, 0.8, 0.0))
    probs = torch.zeros(6)
    probs[kept_ids] = base[kept_ids].softmax(-1)
    # kept_ids has 3 tokens: 13.82 is the 0.999 quantile with 2 degrees of freedom
    assert len(kept_ids) == 3 and chi_square(tokens.cpu(), probs) < 13.82


def test_rejects_mismatched_batch():
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, 5), [make_seq()])
