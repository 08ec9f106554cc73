"""Verification of drafted tokens: which drafts the target model accepts, and the token after them.

A verify chunk of sequence ``b`` scores ``K + 1`` positions: its last known token followed by the
drafts ``d_1 .. d_K``; row ``i`` of its logits is the target's distribution ``p_i`` of the token
after the first ``i`` drafts. Drafts are proposed greedily (a point mass ``q = δ(d)``), so
rejection sampling reduces to: accept ``d_{i+1}`` with probability ``p_i(d_{i+1})``; at the first
rejection emit a token from ``p_i`` with ``d_{i+1}`` removed (renormalised), and after ``K``
acceptances a bonus token from ``p_K``. The emitted tokens are then distributed exactly as
token-by-token sampling would give them. Greedy rows accept while the argmax equals the draft.
Everything stays on the device: no value is read back to the host here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from armillary.sampler import Sampler, _to_device, apply_penalties, mask_stop_tokens_before_min, uses_penalties
from armillary.sequence import Sequence
from armillary.thinking_budget import force_thinking_end


@dataclass(slots=True)
class VerifyOutput:
    """Per sequence ``b`` (rows of the verify chunks, in order):

    tokens:       [B, K+1] int64; ``tokens[b, :num_accepted[b] + 1]`` are emitted (the accepted
                  drafts, then the corrected or bonus token); later entries are the target's own
                  pick at those rows (inputs for the next draft pass only)
    num_accepted: [B] int64, in 0..K
    logprobs:     [B, K+1] float32 raw logprob of ``tokens[b, i]`` at row i; None if no row asked
    top_ids:      [B, K+1, L] int64; top_logprobs: [B, K+1, L] float32; None likewise
    """

    tokens: torch.Tensor
    num_accepted: torch.Tensor
    logprobs: torch.Tensor | None
    top_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None


def _uniform(seqs: list[Sequence], k: int, sampler: Sampler, device: torch.device) -> torch.Tensor:
    """[B, K] U(0, 1) draws: a seeded sequence's from its own CPU generator, the rest shared."""
    out = torch.empty(len(seqs), k, device=device)
    shared = [b for b, seq in enumerate(seqs) if seq.generator is None]
    seeded = [b for b, seq in enumerate(seqs) if seq.generator is not None]
    if shared:
        draws = torch.empty(len(shared), k, device=device).uniform_(generator=sampler.shared_generator(device))
        out[_to_device(shared, torch.int64, device)] = draws
    if seeded:
        host = torch.stack([torch.rand(k, generator=seqs[b].generator) for b in seeded])  # [S, K]
        out[_to_device(seeded, torch.int64, device)] = host.pin_memory().to(device, non_blocking=True) \
            if device.type == "cuda" else host
    return out


def drafts_before_rows(drafts: torch.Tensor) -> torch.Tensor:
    """drafts: [B, K] -> [B(K+1), K] int64: row ``b*(K+1) + i`` holds ``d_1 .. d_i``, then -1."""
    num, k = drafts.shape
    row_of = torch.arange(k + 1, device=drafts.device).repeat(num)  # [B(K+1)] i of each row
    before = torch.arange(k, device=drafts.device)[None, :] < row_of[:, None]  # [B(K+1), K]
    return torch.where(before, drafts[:, None, :].expand(-1, k + 1, -1).reshape(-1, k), -1)


def verify_drafts(logits: torch.Tensor, seqs: list[Sequence], drafts: torch.Tensor, max_accept: torch.Tensor,
                  sampler: Sampler, force_accept: bool = False) -> VerifyOutput:
    """logits: [B * (K+1), V] raw, rows of sequence b at ``b*(K+1) .. b*(K+1)+K``; drafts: [B, K]
    int64; max_accept: [B] int64, the most drafts a sequence may accept (0 where its sampling
    depends on the tokens before it in ways the rows cannot see: a thinking budget near its end;
    fewer where a grammar rejects a draft). Penalties and min_tokens are exact on every row: row i
    counts the drafts before it. ``force_accept`` (benchmarks only) accepts up to ``max_accept``
    whatever the target says."""
    num, k = drafts.shape
    width = k + 1
    if logits.shape[0] != num * width:
        raise ValueError(f"verify_drafts: {logits.shape[0]} logits rows for {num} sequences × {width}")
    logits = logits.float()
    device, vocab = logits.device, logits.shape[1]
    rows = [seq for seq in seqs for _ in range(width)]
    # row i sees the history plus drafts d_1..d_i: penalties and min_tokens exact on every row
    extra = drafts_before_rows(drafts) if uses_penalties(seqs) else None  # [B(K+1), K]
    processed = mask_stop_tokens_before_min(apply_penalties(logits, seqs, extra), seqs)  # [B(K+1), V]
    # a thinking budget sees the tokens before row 0 only: right for row 0, all such a sequence
    # may use near its budget (max_accept 0 there)
    processed = force_thinking_end(processed, rows)
    target = processed.argmax(dim=-1).view(num, width)  # greedy rows' picks
    tokens = target
    accept = target[:, :k] == drafts  # [B, K]
    sampled = [b for b, seq in enumerate(seqs) if not seq.params.greedy]
    if sampled:
        idx = _to_device(sampled, torch.int64, device)
        srows = [rows[b * width + i] for b in sampled for i in range(width)]
        row_idx = (idx[:, None] * width + torch.arange(width, device=device)).reshape(-1)  # [S(K+1)]
        weights = sampler.filtered(processed.index_select(0, row_idx), srows)  # [S(K+1), V] log-weights
        probs = weights.softmax(dim=-1).view(len(sampled), width, vocab)
        d = drafts.index_select(0, idx)  # [S, K]
        p_draft = probs[:, :k].gather(2, d[:, :, None]).squeeze(2)  # [S, K]
        accept_s = _uniform([seqs[b] for b in sampled], k, sampler, device) < p_draft
        # the token after a rejection comes from p without the rejected draft
        residual = weights.view(len(sampled), width, vocab).clone()
        residual[:, :k].scatter_(2, d[:, :, None], float("-inf"))
        noise = sampler.exponential_noise(srows, vocab, device).view(len(sampled), width, vocab)
        picks = (residual - noise.log()).argmax(dim=-1)  # [S, K+1]
        # a draft of probability ~1 leaves an empty residual (all -inf): argmax 0 there is never emitted
        accept = accept.index_copy(0, idx, accept_s)
        tokens = target.index_copy(0, idx, picks)
    if force_accept:
        accept = torch.ones_like(accept)
    accept &= torch.arange(k, device=device)[None, :] < max_accept[:, None]
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [B] length of the accepted prefix
    pos = torch.arange(width, device=device)[None, :]
    drafts_pad = torch.cat([drafts, drafts[:, :1]], dim=1)  # [B, K+1]
    tokens = torch.where(pos < num_accepted[:, None], drafts_pad, tokens)
    logprobs, top_ids, top_logprobs = Sampler.raw_logprobs(logits, tokens.reshape(-1), rows)
    if logprobs is not None:
        logprobs = logprobs.view(num, width)
        top_ids = top_ids.view(num, width, -1)
        top_logprobs = top_logprobs.view(num, width, -1)
    return VerifyOutput(tokens, num_accepted, logprobs, top_ids, top_logprobs)

