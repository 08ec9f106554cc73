"""The contract between the engine and the workers that run a model on one device each."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from armillary.cache_spec import LayerCacheSpec
from armillary.memory.planner import MemoryPlan
from armillary.model_base import CausalLM
from armillary.model_runner import LaunchedStep
from armillary.parallel import ParallelContext
from armillary.step_plan import StepPlan


class Worker(ABC):
    """One device's (one rank's) share of a model: the model, its caches, its CUDA graphs and the sampler.

    The engine calls, in order: ``load_model()``; ``cache_budget(layout)`` (bytes this device can
    give the caches, measured after the weights and a warm-up forward); ``init_caches(layout, plan)``
    with the one plan made from every worker's budget; ``apply_kv_scales``; then ``launch(plan)`` once
    per step. Workers
    decide nothing about scheduling: a ``StepPlan`` says what to compute, the worker executes its
    cache operations, forward and sampling, and hands back a ``LaunchedStep`` whose ``wait()``
    gives the host ``StepOutput`` (the driver rank's; other ranks return theirs unread). Tensor
    parallelism adds workers behind this interface without changing the engine.
    """

    parallel: ParallelContext

    @abstractmethod
    def load_model(self) -> CausalLM:
        """Build the model for ``parallel`` on this device and fill its weights."""

    @abstractmethod
    def cache_budget(self, layout: list[LayerCacheSpec | None]) -> int:
        """Bytes this device can spend on KV blocks and state rows."""

    @abstractmethod
    def init_caches(self, layout: list[LayerCacheSpec | None], plan: MemoryPlan, num_drafts: int = 0,
                    main_layers: int | None = None) -> None:
        """Allocate the caches ``plan`` describes; capture CUDA graphs where they are used.

        ``num_drafts`` > 0: speculation is on; ``layout[main_layers:]`` are the draft head's layers.
        """

    @abstractmethod
    def apply_kv_scales(self, layout: list[LayerCacheSpec | None], calibration_tokens: int, vocab_size: int,
                        block_size: int, dtype: torch.dtype) -> str:
        """Fill the fp8 KV caches' scales (``kv_cache.apply_kv_scales``: the checkpoint's, else calibrated, else
        1.0), the same on every rank; returns where they came from."""

    @abstractmethod
    def launch(self, plan: StepPlan) -> LaunchedStep:
        """Enqueue one step; the result is read with ``LaunchedStep.wait()``."""

    def check_health(self) -> None:
        """Raise (``RankFailed``) when this worker can no longer serve, found without a collective (a rank's process
        gone); the server's idle engine thread asks every second. One process has nothing to check."""

    def close(self) -> None:
        """Release what the worker holds besides its tensors (other ranks' processes, process groups); the engine
        calls it once, at shutdown. A single-device worker holds nothing of the kind."""
