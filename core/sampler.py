"""Turns one step's logits into tokens, with vLLM's semantics.

Order: raw logprobs -> penalties -> min_tokens stop masking -> thinking-budget forcing -> greedy
argmax, or temperature -> top-k -> top-p -> min-p -> exponential-race sampling. The reference path: plain torch, runs on the
logits' device (CPU or CUDA), vectorised over the batch, and never reads a device value back to
the host.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from armillary.sequence import Sequence
from armillary.thinking_budget import force_thinking_end

# the smallest positive float32: an Exp(1) draw of exactly 0 would make -log(q) infinite
_TINY = torch.finfo(torch.float32).tiny


@dataclass(slots=True)
class SamplerOutput:
    """One step's sampled tokens; ``K`` = the largest ``params.logprobs`` in the batch.

    token_ids:    [B] int64
    logprobs:     [B] float32, the sampled token's log_softmax(raw logits); None if no row asked
    top_ids:      [B, K] int64, the K most likely tokens under the raw logits; None likewise
    top_logprobs: [B, K] float32; None likewise
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None
    top_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a device tensor, copied without blocking the host on CUDA."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        # pinned memory makes the copy asynchronous instead of a stream synchronisation
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _padded_token_ids(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """rows of token ids -> [B, L] int64, padded with ``pad`` (L >= 1 so scatters stay valid)."""
    width = max(1, max(len(r) for r in rows))
    return _to_device([r + [pad] * (width - len(r)) for r in rows], torch.int64, device)


def _token_counts(rows: list[list[int]], vocab: int, device: torch.device, repeat: int = 1,
                  extra: torch.Tensor | None = None) -> torch.Tensor:
    """rows of host token ids -> [B * repeat, V] float32 occurrence counts (each row ``repeat``
    times), plus ``extra``: [B * repeat, L] int64 device ids (-1 = none) added to their rows."""
    ids = _padded_token_ids(rows, vocab, device)  # [B, L], pad = V lands in a spare column
    counts = torch.zeros(len(rows), vocab + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    if repeat > 1:  # repeat, not repeat_interleave: a copy of known size, and writable (unlike expand)
        counts = counts[:, None].repeat(1, repeat, 1).reshape(-1, vocab + 1)  # [B * repeat, V + 1]
    if extra is not None:
        extra_ids = torch.where(extra >= 0, extra, vocab)  # [B * repeat, L]; none -> the spare column
        counts.scatter_add_(1, extra_ids, torch.ones_like(extra_ids, dtype=torch.float32))
    return counts[:, :vocab]


def uses_penalties(seqs: list[Sequence]) -> bool:
    """Whether any of ``seqs`` asks for a repetition, frequency or presence penalty."""
    return any(s.params.repetition_penalty != 1.0 or s.params.frequency_penalty != 0.0
               or s.params.presence_penalty != 0.0 for s in seqs)


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence], extra: torch.Tensor | None = None) -> torch.Tensor:
    """vLLM's repetition, frequency and presence penalties; returns a new tensor.

    logits: [B * R, V], R rows per sequence (rows ``b*R .. b*R+R-1`` are ``seqs[b]``'s: R = 1, or
    K + 1 in a verify step). Repetition counts prompt and output tokens: a seen token's logit is
    divided by the penalty when positive, multiplied when not. Frequency subtracts penalty × count
    and presence subtracts penalty × (count > 0), over output tokens only. ``extra``: [B * R, L]
    int64 device ids (-1 = none), output tokens of each row not in its host history yet (the token
    the step in flight is sampling, or the drafts before a verify row): counted without a host read.
    """
    params = [s.params for s in seqs]
    use_repetition = any(p.repetition_penalty != 1.0 for p in params)
    use_output = any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params)
    if not (use_repetition or use_output):
        return logits
    vocab, device = logits.shape[1], logits.device
    repeat = logits.shape[0] // len(seqs)
    if logits.shape[0] != repeat * len(seqs):
        raise ValueError(f"apply_penalties: {logits.shape[0]} logits rows for {len(seqs)} sequences")

    def per_row(values: list[float]) -> torch.Tensor:  # [B * R, 1]
        row = _to_device(values, torch.float32, device)
        return row[:, None].expand(-1, repeat).reshape(-1, 1)

    if use_repetition:
        # rows without the penalty get no history: their scaling is 1 either way (extra tokens too)
        seen_rows = [s.token_ids if s.params.repetition_penalty != 1.0 else [] for s in seqs]
        seen = _token_counts(seen_rows, vocab, device, repeat, extra) > 0  # [B * R, V]
        penalty = torch.where(seen, per_row([p.repetition_penalty for p in params]), 1.0)  # [B * R, V]
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    if use_output:
        output_rows = [s.output_token_ids if s.params.frequency_penalty != 0.0
                       or s.params.presence_penalty != 0.0 else [] for s in seqs]
        counts = _token_counts(output_rows, vocab, device, repeat, extra)  # [B * R, V]
        frequency = per_row([p.frequency_penalty for p in params])
        presence = per_row([p.presence_penalty for p in params])
        logits = logits - frequency * counts - presence * (counts > 0).float()
    return logits


def mask_stop_tokens_before_min(logits: torch.Tensor, seqs: list[Sequence], ahead: int = 0) -> torch.Tensor:
    """Forbid stop tokens while the output is shorter than ``min_tokens``; returns a new tensor if any.

    logits: [B * R, V], R rows per sequence as in ``apply_penalties``; row ``r`` of ``seqs[b]``
    follows ``num_output_tokens + ahead + r`` output tokens (``ahead``: tokens sampled on the
    device and not on the host yet; ``r``: the drafts before a verify row). Masked:
    ``stop_token_ids``, plus ``eos_token_ids`` unless ``ignore_eos``. Ids outside the vocab are skipped.
    """
    vocab = logits.shape[1]
    repeat = logits.shape[0] // max(1, len(seqs))
    rows: list[int] = []
    cols: list[int] = []
    for i, seq in enumerate(seqs):
        p = seq.params
        before = seq.num_output_tokens + ahead
        if before >= p.min_tokens:
            continue
        stops = set(p.stop_token_ids or [])
        if not p.ignore_eos:
            stops.update(seq.eos_token_ids)
        stops = sorted(t for t in stops if 0 <= t < vocab)
        for r in range(min(repeat, p.min_tokens - before)):
            rows.extend([i * repeat + r] * len(stops))
            cols.extend(stops)
    if not rows:
        return logits
    index = (_to_device(rows, torch.int64, logits.device), _to_device(cols, torch.int64, logits.device))
    return logits.index_put(index, torch.tensor(float("-inf"), device=logits.device))


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                            min_p: torch.Tensor | None) -> torch.Tensor:
    """Set filtered-out tokens to -inf, in vLLM's v0 order: top-k, then top-p, then min-p.

    logits: [N, V] (temperature already applied); top_k: [N] int64, V where off; top_p: [N]
    float32, 1 where off; min_p: [N] float32, 0 where off; a None filter is off for every row.
    top-k keeps exactly k tokens (ties broken by sort order); top-p keeps the smallest prefix of
    the sorted distribution whose mass reaches top_p (at least one token); min-p drops tokens
    whose probability is below min_p × the largest.
    """
    neg_inf = float("-inf")
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [N, V]
    if top_k is not None:
        ranks = torch.arange(logits.shape[1], device=logits.device)
        sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= top_k[:, None], neg_inf)
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # [N, V] mass of the strictly likelier tokens
        drop = (mass_before >= top_p[:, None]) & (top_p < 1.0)[:, None]  # rounding must not cut at p=1
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, neg_inf)
    if min_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        # renormalising after earlier filters keeps each prob / max prob, so the order is harmless
        sorted_logits = sorted_logits.masked_fill(probs < min_p[:, None] * probs[:, :1], neg_inf)
    return torch.full_like(logits, neg_inf).scatter(1, order, sorted_logits)


class Sampler:
    """Samples one token per row of ``logits: [B, V]`` for ``seqs[b]``.

    A row whose sequence has a ``generator`` (a per-request seed) draws its noise from it on the
    CPU, so its tokens do not depend on the rest of the batch or on the device; the other rows
    share one generator per device, seeded from ``seed`` (random when None).
    """

    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed
        self._shared_generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], pending: torch.Tensor | None = None
                 ) -> SamplerOutput:
        """``pending``: [B] int64 device ids, each sequence's latest token, sampled by the step still
        in flight and not in ``token_ids`` yet (async scheduling): penalties and min_tokens count it."""
        if logits.dim() != 2 or logits.shape[0] != len(seqs):
            raise ValueError(f"logits must be [B, V] with B = {len(seqs)} sequences, got {tuple(logits.shape)}")
        logits = logits.float()
        device = logits.device
        extra = pending.to(torch.int64)[:, None] if pending is not None else None  # [B, 1]
        processed = apply_penalties(logits, seqs, extra)
        processed = mask_stop_tokens_before_min(processed, seqs, ahead=int(pending is not None))  # [B, V]
        processed = force_thinking_end(processed, seqs)

        greedy_rows = [i for i, s in enumerate(seqs) if s.params.greedy]
        sampled_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if greedy_rows:
            token_ids = processed.argmax(dim=-1)  # [B]; sampled rows are overwritten below
        else:
            token_ids = torch.empty(len(seqs), dtype=torch.int64, device=device)
        if sampled_rows:
            if greedy_rows:
                index = _to_device(sampled_rows, torch.int64, device)
                chosen = self._sample(processed.index_select(0, index), [seqs[i] for i in sampled_rows])
                token_ids = token_ids.index_copy(0, index, chosen)
            else:
                token_ids = self._sample(processed, seqs)

        logprobs, top_ids, top_logprobs = self.raw_logprobs(logits, token_ids, seqs)
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs, top_ids=top_ids, top_logprobs=top_logprobs)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """logits: [N, V] after penalties, rows with temperature >= 1e-5 -> [N] int64 tokens."""
        logits = self.filtered(logits, seqs)
        # exponential race: argmax p / q with q ~ Exp(1) samples p; in log space, logit - log q
        noise = self.exponential_noise(seqs, logits.shape[1], logits.device)  # [N, V]
        return (logits - noise.log()).argmax(dim=-1)

    @staticmethod
    def filtered(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """logits: [N, V] after penalties -> divided by each row's temperature (>= 1e-5), then
        top-k / top-p / min-p filtered: the log-weights of the distribution a row samples from."""
        device, vocab = logits.device, logits.shape[1]
        params = [s.params for s in seqs]
        temperature = _to_device([p.temperature for p in params], torch.float32, device)
        logits = logits / temperature[:, None]
        top_k = top_p = min_p = None
        if any(0 < p.top_k < vocab for p in params):
            top_k = _to_device([p.top_k if 0 < p.top_k < vocab else vocab for p in params], torch.int64, device)
        if any(p.top_p < 1.0 for p in params):
            top_p = _to_device([p.top_p for p in params], torch.float32, device)
        if any(p.min_p > 0.0 for p in params):
            min_p = _to_device([p.min_p for p in params], torch.float32, device)
        if top_k is not None or top_p is not None or min_p is not None:
            logits = apply_top_k_top_p_min_p(logits, top_k, top_p, min_p)
        return logits

    def exponential_noise(self, seqs: list[Sequence], vocab: int, device: torch.device) -> torch.Tensor:
        """[N, V] float32 Exp(1) draws: seeded rows from their own CPU generator, the rest shared."""
        seeded = [i for i, s in enumerate(seqs) if s.generator is not None]
        unseeded = [i for i, s in enumerate(seqs) if s.generator is None]
        shared = None
        if unseeded:
            shared = torch.empty(len(unseeded), vocab, device=device)
            shared.exponential_(generator=self.shared_generator(device))
            if not seeded:
                return shared.clamp_min_(_TINY)
        host = torch.empty(len(seeded), vocab, pin_memory=device.type == "cuda")
        for row, i in enumerate(seeded):
            host[row].exponential_(generator=seqs[i].generator)
        own = host.to(device, non_blocking=True)
        if shared is None:
            return own.clamp_min_(_TINY)
        noise = torch.empty(len(seqs), vocab, device=device)
        noise[_to_device(unseeded, torch.int64, device)] = shared
        noise[_to_device(seeded, torch.int64, device)] = own
        return noise.clamp_min_(_TINY)

    def shared_generator(self, device: torch.device) -> torch.Generator:
        generator = self._shared_generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            if self._seed is None:
                generator.seed()
            else:
                generator.manual_seed(self._seed)
            self._shared_generators[device] = generator
        return generator

    @staticmethod
    def raw_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, seqs: list[Sequence]
                      ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """logits: [B, V] raw; token_ids: [B] -> ([B], [B, K] ids, [B, K]) or Nones if none asked."""
        requested = [s.params.logprobs for s in seqs if s.params.logprobs is not None]
        if not requested:
            return None, None, None
        logprobs = logits.log_softmax(dim=-1)  # [B, V]
        sampled = logprobs.gather(1, token_ids[:, None]).squeeze(1)  # [B]
        top_logprobs, top_ids = logprobs.topk(min(max(requested), logits.shape[1]), dim=-1)  # [B, K]
        return sampled, top_ids, top_logprobs
