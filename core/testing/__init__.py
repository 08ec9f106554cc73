"""Helpers for plugin test suites: tiny transformers checkpoints as the oracle, the engine driven step by step, comparisons.

Shipped with core so that every plugin's tests (this repository's and third parties') hold their
model to transformers the same way without importing each other. The contract:

- **The oracle is transformers, on a checkpoint the test builds.** Nothing downloads: a test
  builds a tiny random ``PreTrainedModel`` of the real ``model_type`` (fp32, eager attention,
  seeded, norms spread so every weight matters), and ``greedy_reference`` saves it with
  ``save_pretrained`` (safetensors) and records transformers' greedy continuation of each
  prompt with the float32 logits behind every new token (EOS suppressed by ``min_new_tokens``,
  so every step of a random model compares). ``hf_greedy`` is the one ``generate`` call behind it.
- **armillary loads that directory as a user's checkpoint would**, through the plugin registered
  by hand (``plugin_registry``), never by entry-point autoload, so a test exercises the code it
  names. Either through the offline API (``LLM``, with ``LogitsRecorder`` catching every logits
  row the engine computes and ``run_staggered`` for arrivals under a small step budget), or
  through ``StepHarness``, which runs exactly the chunks a test picks (mixed prefills and
  decodes, decode steps without host lists as a CUDA graph stages them) on the real engine's
  model, caches and runner.
- **Comparisons raise ``AssertionError``** with the step and the error named, so pytest reports
  them as failures: ``assert_logits_close`` (max |diff| within ``tol`` x max |logit|),
  ``max_relative_error``, ``assert_greedy_matches`` (tokens exact, top-5 log-probabilities within
  ``atol``), ``assert_reference_run`` (a ``Reference``'s prompts batched and alone: tokens exact, every logits
  row within ``tol``), and on a ``StepHarness`` ``assert_stepwise_greedy`` (each prompt alone) and
  ``assert_batched_greedy`` (all prompts in one batch): every step's logits through the suite's own
  check, then the greedy tokens exact. Tolerances are the caller's: each suite states its own.
- Checkpoint rewrites for loader tests: ``read_checkpoint`` / ``write_checkpoint`` (one-shard
  safetensors plus ``config.json``) and ``swap_expert_layout`` (per-expert <-> stacked MoE names).

Nothing here imports transformers or a plugin; the helpers take the model, registry or engine
they act on. ``StepHarness`` reaches into the engine (its cache coordinator, ``runner.prepare`` and
``runner.cache_ops_before``): a core change there keeps it working, so plugins' suites need not
follow. CPU by default, float32: tests stay tiny and run in seconds.
"""
from __future__ import annotations

from armillary.testing.compare import (
    assert_batched_greedy,
    assert_greedy_matches,
    assert_logits_close,
    assert_reference_run,
    assert_stepwise_greedy,
    max_relative_error,
)
from armillary.testing.drive import (
    LogitsRecorder,
    StepHarness,
    cpu_engine,
    greedy_params,
    paged_batch,
    plugin_registry,
    run_staggered,
)
from armillary.testing.reference import (
    Reference,
    greedy_reference,
    hf_greedy,
    lazy_references,
    read_checkpoint,
    swap_expert_layout,
    write_checkpoint,
)

__all__ = [
    "LogitsRecorder", "Reference", "StepHarness", "assert_batched_greedy", "assert_greedy_matches",
    "assert_logits_close", "assert_reference_run", "assert_stepwise_greedy", "cpu_engine", "greedy_params", "greedy_reference", "hf_greedy",
    "lazy_references", "max_relative_error", "paged_batch", "plugin_registry", "read_checkpoint", "run_staggered",
    "swap_expert_layout", "write_checkpoint",
]
