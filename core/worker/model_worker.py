"""The worker of one device: builds and loads the model, measures the cache budget, owns the step machinery."""
from __future__ import annotations

import logging
from contextlib import contextmanager

import torch

from armillary.cache_spec import LayerCacheSpec
from armillary.config import EngineConfig
from armillary.cuda_graphs import CUDAGraphDecoder
from armillary.hf_config import HFConfig
from armillary.layers import process_weights_after_loading
from armillary.layers.quantization import QuantConfig, get_quant_config, use_quant_config
from armillary.layers.quantization.kv_cache import apply_kv_scales
from armillary.memory.planner import GiB, MemoryPlan, allocate_caches, cuda_cache_budget, plan_memory
from armillary.model_base import CausalLM
from armillary.model_runner import LaunchedStep, ModelRunner
from armillary.parallel import SINGLE, ParallelContext, use_parallel
from armillary.sampler import Sampler
from armillary.sampling_params import SamplingParams
from armillary.sequence import Sequence
from armillary.shard_reads import BYTES_READ, close_maps
from armillary.speculative.graphs import SpecGraphs
from armillary.speculative.proposer import DraftProposer
from armillary.speculative.step import SpeculativeConfig
from armillary.step_plan import ScheduledChunk, StepPlan
from armillary.structured.outputs import StructuredOutputs
from armillary.weights import fill_parameters
from armillary.worker.base import Worker

log = logging.getLogger("armillary")


@contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def fresh_peak(device: torch.device) -> None:
    """Restart the allocator's peak at what is held now: the planner reads peak − current as the activation
    peak, and neither the loader's read buffers, repacking temporaries nor an earlier engine of this process
    (its weights and caches, freed by ``shutdown``) are one."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)


class ModelWorker(Worker):
    """Runs the whole model on ``device`` (one rank of ``parallel``); see ``Worker`` for the contract."""

    def __init__(self, config: EngineConfig, model_cls: type[CausalLM], hf_config: HFConfig, source,
                 device: torch.device, dtype: torch.dtype, max_model_len: int,
                 parallel: ParallelContext = SINGLE, quant: QuantConfig | None = None,
                 structured: StructuredOutputs | None = None) -> None:
        self.config = config
        self.model_cls = model_cls
        self.hf_config = hf_config
        self.source = source
        self.device = device
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.parallel = parallel
        self.quant = quant
        self.structured = structured
        self.model: CausalLM | None = None
        self.runner: ModelRunner | None = None
        self.caches = None
        self.states = None

    def load_model(self) -> CausalLM:
        quant = self.quant or get_quant_config()
        with use_parallel(self.parallel), use_quant_config(quant), torch.device(self.device), _default_dtype(self.dtype):
            self.model = self.model_cls(self.hf_config)
        if self.config.load_format == "dummy":
            self._init_dummy_weights()
        else:
            fill_parameters(self.model, self._weights(), str(self.source.path))
            close_maps()
        process_weights_after_loading(self.model)  # quant methods repack what they loaded, once
        self.model.eval()
        if self.device.type == "cuda":
            fresh_peak(self.device)
        return self.model

    def _weights(self):
        """The checkpoint's tensors: streamed onto the device, or with several ranks the source's views
        (``weight_views``), so this rank copies out only the slices its layers keep."""
        views = self.source.weight_views() if self.parallel.world_size > 1 else None
        if views is None:
            yield from self.source.weights_on(self.device)
            return
        before = BYTES_READ[0]
        yield from views
        log.info("rank %d copied %.3g GB of its shard out of the checkpoint", self.parallel.rank,
                 (BYTES_READ[0] - before) / 1e9)

    def _init_dummy_weights(self) -> None:
        gen = torch.Generator(device=self.device).manual_seed(self.config.seed)
        with torch.no_grad():
            for p in self.model.parameters():
                if p.is_floating_point():
                    p.uniform_(-0.02, 0.02, generator=gen)

    def cache_budget(self, layout: list[LayerCacheSpec | None]) -> int:
        if self.device.type != "cuda":
            return int(self.config.cpu_kv_cache_space_gb * GiB)
        self._profile_run(layout)
        return cuda_cache_budget(self.device, self.config.gpu_memory_utilization)

    def _profile_run(self, layout: list[LayerCacheSpec | None]) -> None:
        """One full-budget prefill on throw-away caches, so the planner sees the activation peak."""
        cfg = self.config
        n = min(cfg.max_num_batched_tokens, self.max_model_len)
        blocks = -(-n // cfg.block_size) + 1  # + the scratch block 0
        tmp = plan_memory(layout, budget_bytes=0, block_size=cfg.block_size, num_slots=2, dtype=self.dtype,
                          max_model_len=n, max_num_seqs=1, max_chunk=n, num_blocks_override=blocks)
        caches, states = allocate_caches(layout, tmp, self.dtype, self.device)
        runner = ModelRunner(self.model, caches, cfg.block_size, self.device, states=states,
                             num_groups=max(1, len(tmp.paged_groups)))
        seq = Sequence("profile", 0, [0] * n, SamplingParams(max_tokens=1, temperature=0.0))
        seq.block_tables = [list(range(1, blocks)) for _ in tmp.paged_groups]
        seq.state_slot = 0
        runner.launch(StepPlan([ScheduledChunk(seq, 0, n, sample=True)], zero_slots=[0]))
        del runner, caches, states
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    def init_caches(self, layout: list[LayerCacheSpec | None], plan: MemoryPlan, num_drafts: int = 0,
                    main_layers: int | None = None) -> None:
        cfg = self.config
        self.caches, self.states = allocate_caches(layout, plan, self.dtype, self.device)
        num_groups = max(1, len(plan.paged_groups))
        scratch_block, scratch_slot = 0, plan.num_slots - 1
        speculative = proposer = None
        if num_drafts:
            speculative = SpeculativeConfig(num_drafts, plan.num_slots + plan.num_snapshots,
                                            force_accept=cfg.speculative_force_accept)
            host_lists = self.device.type != "cuda" or cfg.kernel_backend == "reference"
            proposer = DraftProposer(self.model, self.caches[main_layers:], num_drafts, cfg.block_size, host_lists)
        graphs = spec_graphs = None
        use_graphs = self.device.type == "cuda" and not cfg.enforce_eager and cfg.kernel_backend == "auto"
        max_blocks = -(-self.max_model_len // cfg.block_size)
        if use_graphs and num_drafts:
            spec_graphs = SpecGraphs(self.model, proposer, self.caches, min(cfg.max_num_seqs, cfg.max_graph_batch),
                                     speculative, max_blocks, cfg.block_size, scratch_slot,
                                     self.device, num_groups=num_groups)
            spec_graphs.capture()
        if use_graphs and not num_drafts:
            graphs = CUDAGraphDecoder(self.model, self.caches, min(cfg.max_num_seqs, cfg.max_graph_batch),
                                      max_blocks, cfg.block_size, scratch_block, scratch_slot, self.device,
                                      num_groups=num_groups)
            graphs.capture()
        self.runner = ModelRunner(self.model, self.caches, cfg.block_size, self.device, Sampler(seed=cfg.seed),
                                  graphs, structured=self.structured, states=self.states, num_groups=num_groups,
                                  speculative=speculative, proposer=proposer)
        self.runner.spec_graphs = spec_graphs

    def apply_kv_scales(self, layout: list[LayerCacheSpec | None], calibration_tokens: int, vocab_size: int,
                        block_size: int, dtype: torch.dtype) -> str:
        source = apply_kv_scales(self.caches, self.model, layout, calibration_tokens, vocab_size, block_size, dtype)
        scaled = [c for c in self.caches if c is not None and getattr(c, "k_scale", None) is not None]
        if source == "calibrated" and self.parallel.world_size > 1:
            # each rank measured its own heads: every rank takes the largest, as one process over all heads would
            for t in (s for c in scaled for s in (c.k_scale, c.v_scale)):
                torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return source

    def launch(self, plan: StepPlan) -> LaunchedStep:
        return self.runner.launch(plan)
