"""Draft verification (``verify_drafts``): greedy acceptance of the longest matching prefix, and
rejection sampling that leaves the output distribution exactly the target's (checked by
chi-square tests on a tiny vocabulary over many independent sequences)."""
from __future__ import annotations

import pytest
import torch

from armillary.sampler import Sampler
from armillary.sampling_params import SamplingParams
from armillary.sequence import Sequence
from armillary.speculative.verify import verify_drafts

V = 5


def _seqs(n: int, **params) -> list[Sequence]:
    return [Sequence(str(i), 0, [1, 2], SamplingParams(**params)) for i in range(n)]


def _chi2_ok(counts: torch.Tensor, probs: torch.Tensor) -> bool:
    """Pearson's chi-square against ``probs`` below the 99.9% quantile for V - 1 = 4 degrees of freedom."""
    expected = probs * counts.sum()
    stat = ((counts - expected) ** 2 / expected.clamp_min(1e-9)).sum().item()
    return stat < 18.47


def test_greedy_accepts_the_longest_matching_prefix_then_the_targets_token():
    # rows: target argmax per row of 3 sequences, K = 3
    target = torch.tensor([[1, 2, 3, 4], [1, 0, 3, 4], [0, 2, 3, 4]])
    logits = torch.nn.functional.one_hot(target.reshape(-1), V).float() * 5  # [12, V]
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    out = verify_drafts(logits, _seqs(3, temperature=0.0), drafts, torch.tensor([3, 3, 3]), Sampler(seed=0))
    assert out.num_accepted.tolist() == [3, 1, 0]
    assert out.tokens[0].tolist() == [1, 2, 3, 4]  # all accepted, then the bonus token
    assert out.tokens[1, :2].tolist() == [1, 0]  # one accepted, then the target's own pick
    assert out.tokens[2, :1].tolist() == [0]


def test_max_accept_caps_and_force_accept_accepts():
    target = torch.tensor([[1, 2, 3], [1, 2, 3]])
    logits = torch.nn.functional.one_hot(target.reshape(-1), V).float() * 5
    drafts = torch.tensor([[1, 2], [4, 4]])
    out = verify_drafts(logits, _seqs(2, temperature=0.0), drafts, torch.tensor([1, 2]), Sampler(seed=0))
    assert out.num_accepted.tolist() == [1, 0]
    forced = verify_drafts(logits, _seqs(2, temperature=0.0), drafts, torch.tensor([1, 2]), Sampler(seed=0),
                           force_accept=True)
    assert forced.num_accepted.tolist() == [1, 2]
    assert forced.tokens[1].tolist() == [4, 4, 3]


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_rejection_sampling_keeps_the_target_distribution(top_p):
    """N sequences, K = 2, the same target rows and drafts: the first emitted token follows p_0;
    given it equals d_1, the second follows p_1; given both drafts, the bonus follows p_2."""
    n, k = 40000, 2
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(k + 1, V, generator=gen) * 1.5  # [K+1, V] target logits, the same for every sequence
    logits = rows.repeat(n, 1)  # [N(K+1), V]
    drafts = torch.tensor([[3, 1]]).repeat(n, 1)
    seqs = _seqs(n, temperature=0.9, top_p=top_p)
    out = verify_drafts(logits, seqs, drafts, torch.full((n,), k), Sampler(seed=1))
    probs = Sampler.filtered(rows, seqs[: k + 1]).softmax(dim=-1)  # [K+1, V] the distributions to match
    tokens, acc = out.tokens, out.num_accepted
    assert _chi2_ok(torch.bincount(tokens[:, 0], minlength=V).float(), probs[0])
    first = acc >= 1  # the first emitted token was d_1
    assert first.float().mean().item() == pytest.approx(probs[0, 3].item(), abs=0.01)
    assert _chi2_ok(torch.bincount(tokens[first, 1], minlength=V).float(), probs[1])
    both = acc == 2
    assert _chi2_ok(torch.bincount(tokens[both, 2], minlength=V).float(), probs[2])


def test_seeded_sequences_verify_reproducibly():
    logits = torch.randn(3 * 4, V, generator=torch.Generator().manual_seed(2))
    drafts = torch.tensor([[0, 1, 2]])

    def run():
        seq = Sequence("s", 0, [1], SamplingParams(temperature=1.0, seed=5), seed=5)
        return verify_drafts(logits[:4], [seq], drafts, torch.tensor([3]), Sampler(seed=None)).tokens

    assert torch.equal(run(), run())
