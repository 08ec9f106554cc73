"""Per-request bookkeeping in the engine: its sequences, detokenizers and stop-string checks."""
from __future__ import annotations

import time

from armillary.outputs import CompletionOutput, RequestOutput, TokenLogprob
from armillary.sequence import Sequence


class SeqText:
    """A sequence's decoded text with stop strings applied.

    ``visible`` holds back the last ``max_stop_len - 1`` characters while running, since they
    may be the start of a stop string.
    """

    def __init__(self, detokenizer, stops: list[str], include_stop: bool) -> None:
        self.detokenizer = detokenizer
        self.stops = stops
        self.include_stop = include_stop
        self.text = ""
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.stopped = False  # a stop string cut the text: nothing after it may be added

    def add(self, token_id: int) -> str | None:
        """Append one token; returns the stop string if one now appears in the text."""
        if self.detokenizer is None:
            return None
        delta = self.detokenizer.add(token_id)
        if not delta:
            return None
        start = max(0, len(self.text) - self.hold)
        self.text += delta
        for stop in self.stops:
            at = self.text.find(stop, start)
            if at != -1:
                self.text = self.text[: at + len(stop) if self.include_stop else at]
                self.stopped = True
                return stop
        return None

    def finish(self) -> None:
        """Release text the detokenizer held back (an incomplete multi-byte character)."""
        if self.detokenizer is not None and not self.stopped:
            self.text += self.detokenizer.flush()

    def visible(self, finished: bool) -> str:
        if finished or self.hold == 0:
            return self.text
        return self.text[: max(0, len(self.text) - self.hold)]


class RequestState:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 seqs: list[Sequence], texts: list[SeqText]) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.seqs = seqs
        self.texts = texts
        self.metrics: dict[str, float] = {"arrival_time": time.time()}

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def output(self) -> RequestOutput:
        outs = []
        for seq, text in zip(self.seqs, self.texts):
            lps = None
            if seq.params.logprobs is not None:
                lps = [TokenLogprob(tok, lp, top) for tok, (lp, top) in zip(seq.output_token_ids, seq.logprobs)]
            outs.append(CompletionOutput(seq.index, text.visible(seq.is_finished), seq.output_token_ids,
                                         seq.finish_reason, seq.stop_reason, lps))
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs, self.finished,
                             dict(self.metrics))
