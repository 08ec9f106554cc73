"""Thinking budgets: the forced end-of-thinking marker, the logits forcing, reasoning ending at 16 tokens in the engine.

The marker of one or several tokens, the model's own, rolled back drafts; through the engine on a
tiny Qwen3-Next with an MTP head, with and without speculation, the tokens before the budget being
the unbudgeted ones.
"""
from __future__ import annotations

import pytest
import torch

from armillary.errors import InvalidRequestError
from armillary.sampling_params import SamplingParams
from armillary.thinking_budget import ThinkingBudget, force_thinking_end
from plugins.qwen_gdn_moe.tests.harness import build_engine
from plugins.qwen_gdn_moe.tests.hf_models import CASES_BY_NAME, VOCAB
from plugins.qwen_gdn_moe.tests.mtp_checkpoint import save_with_mtp
from tests.fixtures.engine_runs import run_to_completion
from tests.fixtures.tiny_tokenizer import make_qwen_tokenizer

PROMPT_IDS = [1, 2, 3]  # the unit tests' "prompt"


def _forced_run(budget: ThinkingBudget, model_tokens: list[int]) -> list[int]:
    """Append, position by position, the forced token if any, else the model's next one."""
    ids = list(PROMPT_IDS)
    pending = list(model_tokens)
    while pending:
        forced = budget.forced_token(ids, len(PROMPT_IDS))
        ids.append(forced if forced is not None else pending.pop(0))
    return ids[len(PROMPT_IDS):]


def test_single_token_marker_forced_once_at_the_budget():
    out = _forced_run(ThinkingBudget(4, (99,)), [10, 11, 12, 13, 14, 15, 16])
    assert out[:5] == [10, 11, 12, 13, 99] and 99 not in out[5:]
    assert len(out) == 8  # the model's tokens go on after the marker


def test_multi_token_marker_forced_token_by_token_then_left_alone():
    out = _forced_run(ThinkingBudget(3, (97, 98, 99)), [10, 11, 12, 13, 14])
    assert out == [10, 11, 12, 97, 98, 99, 13, 14]


def test_marker_the_model_writes_itself_ends_the_budget():
    budget = ThinkingBudget(5, (97, 98))
    out = _forced_run(budget, [10, 97, 98, 11, 12, 13, 14, 15])
    assert out == [10, 97, 98, 11, 12, 13, 14, 15]  # closed at 3 tokens: nothing forced later
    assert budget.reasoning_ended(PROMPT_IDS + out, len(PROMPT_IDS))


def test_model_starting_the_marker_at_the_budget_is_completed_not_restarted():
    budget = ThinkingBudget(2, (97, 98, 99))
    ids = PROMPT_IDS + [10, 11, 97]  # at the budget the model wrote the marker's first token itself
    assert budget.forced_token(ids, 3) == 98


def test_rolled_back_marker_is_forgotten():
    budget = ThinkingBudget(2, (99,))
    ids = PROMPT_IDS + [10, 11, 99, 12]
    assert budget.reasoning_ended(ids, 3) and budget.forced_token(ids, 3) is None
    del ids[-2:]  # rejected drafts cut the marker back off
    assert not budget.reasoning_ended(ids, 3) and budget.forced_token(ids, 3) == 99


def test_reads_history_near_the_budget_only():
    budget = ThinkingBudget(10, (99,))
    assert not budget.reads_history(PROMPT_IDS + [0] * 5, 3)
    assert budget.reads_history(PROMPT_IDS + [0] * 6, 3)  # a 3-draft verify step could reach the budget
    assert not budget.reads_history(PROMPT_IDS + [0] * 6 + [99], 3)  # reasoning over


class _Seq:
    def __init__(self, output: list[int], budget: ThinkingBudget | None) -> None:
        self.token_ids = PROMPT_IDS + output
        self.num_prompt_tokens = len(PROMPT_IDS)
        self.thinking = budget


def test_force_thinking_end_leaves_only_the_marker_in_forced_rows():
    logits = torch.randn(3, 7)
    logits[1, 5] = float("-inf")  # masked by a grammar: still forced
    seqs = [_Seq([1, 2], ThinkingBudget(2, (5,))), _Seq([1, 2], ThinkingBudget(2, (5,))), _Seq([1], None)]
    seqs[0].thinking = ThinkingBudget(3, (5,))  # under budget
    out = force_thinking_end(logits.clone(), seqs)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert out[1].argmax().item() == 5 and torch.isinf(out[1]).sum().item() == 6


# ---- through the engine

@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    path = save_with_mtp(CASES_BY_NAME["next_full_last"], tmp_path_factory.mktemp("think_mtp"))
    make_qwen_tokenizer(path, vocab_size=VOCAB)
    return path


def _chat_prompt(engine, thinking: bool) -> list[int]:
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Think about the weather."}],
                                                add_generation_prompt=True, enable_thinking=thinking)
    return engine.tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("speculative", [False, True])
def test_engine_ends_reasoning_at_16_tokens(mtp_model, speculative):
    kw = dict(speculative=True, num_drafts=2) if speculative else {}
    engine = build_engine(mtp_model, block_size=8, num_kv_blocks=64, max_num_seqs=4, **kw)
    end = engine.tokenizer.token_to_id("</think>")
    prompt = _chat_prompt(engine, thinking=True)
    free, budgeted, sampled = run_to_completion(engine, [
        (prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)),
        (prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, thinking_budget=16)),
        (prompt, SamplingParams(temperature=0.8, seed=3, max_tokens=40, ignore_eos=True, thinking_budget=16)),
    ])
    assert end not in free[:16]  # random weights: the model would not close reasoning by itself
    for out in (budgeted, sampled):
        assert end not in out[:16] and out[16] == end and out.count(end) == 1, out
    assert budgeted[:16] == free[:16]  # nothing changes before the budget
    if speculative:
        assert engine.stats()["num_verify_steps"] > 0


def test_engine_budget_only_when_the_prompt_opens_reasoning(mtp_model):
    engine = build_engine(mtp_model, block_size=8, num_kv_blocks=64, max_num_seqs=2)
    prompt = _chat_prompt(engine, thinking=False)  # the template closed an empty block already
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    free, budgeted = run_to_completion(engine, [(prompt, params), (prompt, SamplingParams(
        temperature=0.0, max_tokens=24, ignore_eos=True, thinking_budget=4))])
    assert budgeted == free


def test_engine_refuses_a_budget_without_a_reasoning_parser(mtp_model):
    engine = build_engine(mtp_model, block_size=8, num_kv_blocks=64, max_num_seqs=2)
    engine.thinking._parser_name = None  # as an architecture that names no reasoning parser
    with pytest.raises(InvalidRequestError, match="reasoning parser"):
        engine.add_request("x", _chat_prompt(engine, True), SamplingParams(max_tokens=4, thinking_budget=2))
    with pytest.raises(InvalidRequestError, match="thinking_budget"):
        SamplingParams(thinking_budget=-1)
