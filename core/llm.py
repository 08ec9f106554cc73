"""The offline API, shaped like vLLM's: ``LLM(model=...).generate(prompts, sampling_params)``."""
from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from typing import Any

from armillary.config import EngineConfig
from armillary.engine import LLMEngine
from armillary.outputs import RequestOutput
from armillary.registry import PluginRegistry
from armillary.sampling_params import SamplingParams

PromptType = str | dict[str, Any] | list[int]
_SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class LLM:
    """Runs prompts to completion in one call, batching them through the engine.

    Under torchrun (``worker.ranks.launched_rank``) every process builds an ``LLM`` with the same arguments: rank 0's
    is the engine, and on the other ranks the constructor follows rank 0 until it shuts down, then exits the
    process (``SystemExit(0)``): only rank 0 runs the rest of the script."""

    def __init__(self, model: str, registry: PluginRegistry | None = None, **engine_args: Any) -> None:
        config = EngineConfig(model=model, **engine_args)
        from armillary.worker.ranks import follow_rank_zero, launched_rank

        launched = launched_rank()
        if launched is not None and launched.rank > 0:
            from armillary.registry import default_registry

            follow_rank_zero(config, registry or default_registry())
            raise SystemExit(0)
        self.engine = LLMEngine(config, registry=registry)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def shutdown(self) -> None:
        """Free what the engine holds on the device (``LLMEngine.shutdown``); this LLM is unusable after."""
        self.engine.shutdown()

    def default_sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with the checkpoint's generation_config.json defaults, as vLLM does."""
        gen = self.engine.generation_defaults
        return SamplingParams(**{k: gen[k] for k in _SAMPLING_DEFAULTS if k in gen})

    def generate(self, prompts: PromptType | Seq[PromptType],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        """A prompt is a string, ``{"prompt": str}`` or ``{"prompt_token_ids": [...]}``; outputs keep input order."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = self.default_sampling_params()
        params = list(sampling_params) if isinstance(sampling_params, Seq) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = []
        for prompt, p in zip(prompts, params):
            rid = str(next(self._ids))
            self.engine.add_request(rid, _prompt_of(prompt), p)
            ids.append(rid)
        return self._run(ids)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             tools: list[dict] | None = None, add_generation_prompt: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; rendered with the checkpoint's chat template."""
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("this model has no tokenizer, so it has no chat template")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": tok.encode(tok.apply_chat_template(
            conv, tools=tools, add_generation_prompt=add_generation_prompt, **(chat_template_kwargs or {})))}
            for conv in convs]
        return self.generate(prompts, sampling_params)

    def _run(self, ids: list[str]) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        try:
            while len(done) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return [done[rid] for rid in ids]


def _prompt_of(prompt: PromptType) -> str | list[int]:
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        return prompt["prompt"]
    return prompt


__all__ = ["LLM", "SamplingParams"]
