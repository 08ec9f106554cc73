"""armillary's outputs against the transformers reference: logits within a stated tolerance, greedy tokens and log-probabilities."""
from __future__ import annotations

from collections.abc import Callable

import torch

from armillary.sampling_params import SamplingParams
from armillary.testing.drive import LogitsRecorder, greedy_params
from armillary.testing.reference import hf_greedy


def assert_logits_close(got: torch.Tensor, ref: torch.Tensor, what: str, tol: float) -> None:
    """max |got - ref| <= ``tol`` x max(max |ref|, 1): an error relative to the logits' scale, floored for tiny ones."""
    err = (got - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= tol * max(scale, 1.0), f"{what}: max |diff| {err:.3g} against max |logit| {scale:.3g}"


def max_relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref| over every element."""
    return ((got - ref).abs().max() / ref.abs().max()).item()


def assert_greedy_matches(llm, hf_model: torch.nn.Module, prompt_list: list[list[int]], new_tokens: int,
                          atol: float = 1e-4, pad_token_id: int = 0) -> None:
    """``llm``'s greedy tokens equal transformers' for ``new_tokens`` steps (EOS suppressed on both sides),
    and its top-5 log-probabilities agree with ``log_softmax`` of transformers' logits within ``atol`` at every step."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_list], params)
    for prompt, output in zip(prompt_list, outputs):
        ref = hf_greedy(hf_model, prompt, new_tokens, pad_token_id)
        got = output.outputs[0]
        assert got.token_ids == ref.sequences[0, len(prompt):].tolist(), f"prompt {prompt[:8]}..."
        for step, logprob in enumerate(got.logprobs):
            ref_logprobs = torch.log_softmax(ref.logits[step][0].float(), dim=-1)
            for token_id, value in logprob.top:
                assert abs(value - ref_logprobs[token_id].item()) < atol, (step, token_id)


def assert_reference_run(llm, reference, new_tokens: int, tol: float = 1e-4) -> None:
    """``llm`` reproduces a ``Reference``: its prompts all at once, then one at a time with every computed logits row
    recorded, give the reference's greedy tokens, and the rows are within ``tol`` (max_relative_error) of its logits."""
    batch = llm.generate([{"prompt_token_ids": p} for p in reference.prompts], greedy_params(new_tokens))
    assert [o.outputs[0].token_ids for o in batch] == reference.tokens, "the prompts in one batch"
    rec = LogitsRecorder(llm.engine.model)
    try:
        for i, (prompt, tokens, logits) in enumerate(zip(reference.prompts, reference.tokens, reference.logits)):
            out = llm.generate({"prompt_token_ids": prompt}, greedy_params(new_tokens))[0].outputs[0]
            assert out.token_ids == tokens, f"prompt {i} ({len(prompt)} tokens): greedy continuation differs"
            err = max_relative_error(rec.take(), logits)
            assert err < tol, f"prompt {i}: relative logits error {err:.2e}"
    finally:
        rec.close()


def assert_stepwise_greedy(harness, ref, new_tokens: int, close: Callable[[torch.Tensor, torch.Tensor, str], None],
                           decode_only: bool = False) -> None:
    """Each of ``ref``'s prompts alone through ``harness`` (a ``StepHarness``): the prompt's logits, every decode
    step's (``decode_only``: staged as a CUDA graph stages them) and all ``new_tokens`` greedy tokens equal ``ref``'s;
    ``close(got, want, what)`` is the suite's logits check."""
    for seq, prompt in enumerate(ref.prompts):
        logits = harness.step([(seq, prompt)])[0]
        tokens = []
        for step in range(new_tokens):
            close(logits, ref.logits[seq][step], f"prompt {seq} ({len(prompt)} tokens) step {step}")
            tokens.append(int(logits.argmax()))
            logits = harness.step([(seq, tokens[-1:])], decode_only=decode_only)[0]
        assert tokens == ref.tokens[seq], f"prompt {seq}: greedy continuation differs"


def assert_batched_greedy(harness, ref, new_tokens: int, close: Callable[[torch.Tensor, torch.Tensor, str], None],
                          decode_only: bool = False) -> None:
    """All of ``ref``'s prompts prefilled in one step, then decoded together: every step's logits and all greedy
    tokens equal ``ref``'s."""
    logits = harness.step(list(enumerate(ref.prompts)))
    tokens: list[list[int]] = [[] for _ in ref.prompts]
    for step in range(new_tokens):
        for seq in range(len(ref.prompts)):
            close(logits[seq], ref.logits[seq][step], f"prompt {seq} step {step}")
            tokens[seq].append(int(logits[seq].argmax()))
        logits = harness.step([(seq, t[-1:]) for seq, t in enumerate(tokens)], decode_only=decode_only)
    assert tokens == ref.tokens
