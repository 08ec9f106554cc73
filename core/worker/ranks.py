"""Tensor and expert parallelism over processes: rank 0's worker in the engine's process, ranks 1.. spawned on
this host or started by a launcher (torchrun, across hosts), every step's plan broadcast from rank 0.

``RankedWorkers`` is the ``Worker`` the engine drives when ``world_size`` (the larger of the tensor- and the
expert-parallel size: both groups are all the processes) is above 1. Rank r builds the model inside ``use_parallel``
with tp_rank / ep_rank r (the shared layers keep their shard; its loaders get the checkpoint as
``shard_reads.LazySlice`` views and copy out only their slices) on ``cuda:r`` (NCCL for the model's collectives) or
the CPU (gloo). The ranks follow rank 0 through one gloo control group: each ``Worker`` call is broadcast as
(command, payload) and every rank runs it; the cache budget is the smallest any rank measured, the memory plan is
rank 0's. A step's plan travels with host-only fields stripped (thinking budgets, generators, logprobs); the other
ranks compute the same forward, so the all-reduces inside it meet, and their sampled tokens are never read. A rank
that fails reports its traceback on a queue and exits; rank 0 checks the ranks before each command and turns a
failed or timed-out collective into ``RankFailed`` naming the rank.

Under a launcher (``launched_rank``: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, as torchrun does, with a
world above 1) every process runs the same command: rank 0 builds the engine (and serves HTTP), its
``RankedWorkers`` joins the group through ``env://`` and spawns nothing, and the others call
``follow_rank_zero``, which builds their shard on ``cuda:LOCAL_RANK`` (or the CPU) and follows rank 0 until it
stops. A lost launched rank shows as a collective past ``distributed_timeout_s`` (there is no exit code to read).
"""
from __future__ import annotations

import logging
import os
import queue
import shutil
import tempfile
import traceback
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from armillary.cache_spec import LayerCacheSpec
from armillary.layers import collectives
from armillary.memory.planner import MemoryPlan
from armillary.model_base import CausalLM
from armillary.model_runner import LaunchedStep
from armillary.parallel import ParallelContext
from armillary.sequence import Sequence
from armillary.step_plan import StepPlan
from armillary.worker.base import Worker
from armillary.worker.model_worker import ModelWorker

log = logging.getLogger("armillary")
STOP, LOAD, BUDGET, CACHES, KV_SCALES, LAUNCH = ("stop", "load_model", "cache_budget", "init_caches", "kv_scales",
                                                 "launch")
_HOST_ONLY = ("thinking", "generator", "logprobs")  # Sequence fields only the driver's bookkeeping reads


class RankFailed(RuntimeError):
    """A rank exited, raised, or did not answer within ``distributed_timeout_s``."""


@dataclass(frozen=True, slots=True)
class LaunchedRank:
    """This process's place among those a launcher started: global rank, world size, rank on its host."""

    rank: int
    world: int
    local_rank: int


def launched_rank() -> LaunchedRank | None:
    """Where a launcher (torchrun) started this process as one of several: RANK, WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT set and the world above 1; else None."""
    env = os.environ
    if not all(env.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return None
    world = int(env["WORLD_SIZE"])
    if world <= 1:
        return None
    return LaunchedRank(int(env["RANK"]), world, int(env.get("LOCAL_RANK", env["RANK"])))


def check_launched_world(config, launched: LaunchedRank) -> None:
    """The launcher's world must be the engine's ranks: max(tensor-, expert-parallel size)."""
    if launched.world != config.world_size:
        raise ValueError(f"the launcher started {launched.world} processes (WORLD_SIZE) but tensor_parallel_size "
                         f"{config.tensor_parallel_size} / expert_parallel_size {config.expert_parallel_size} make "
                         f"{config.world_size} ranks: give --tp-size / --ep-size for {launched.world}")


def rank_context(rank: int, tp: int, ep: int) -> ParallelContext:
    """Rank ``rank`` of max(tp, ep) processes: the TP group and the EP group (where > 1) are all of them."""
    return ParallelContext(rank=rank, world_size=max(tp, ep), tp_rank=rank if tp > 1 else 0, tp_size=tp,
                           ep_rank=rank if ep > 1 else 0, ep_size=ep)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: the r-th GPU after the configured one, or the CPU."""
    if device.type == "cuda":
        return torch.device("cuda", (device.index or 0) + rank)
    return device


def init_groups(rank: int, world: int, init_method: str, device: torch.device, timeout_s: float):
    """Join the world group (NCCL on GPUs, gloo on the CPU) and return the gloo group commands travel on."""
    timeout = timedelta(seconds=timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=timeout)
    for kind in collectives.KINDS:  # one TP group and one EP group span every process: the world group
        collectives.set_group(kind, None)
    return dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD


def portable_plan(plan: StepPlan) -> StepPlan:
    """``plan`` with each sequence copied without its host-only fields, for the other ranks."""
    if plan.input_tokens is not None:
        raise ValueError("a step whose input tokens are still on the device cannot be sent to other ranks")
    chunks = []
    for chunk in plan.chunks:
        seq = Sequence.__new__(Sequence)
        seq.__dict__.update({k: v for k, v in vars(chunk.seq).items() if k not in _HOST_ONLY})
        seq.thinking, seq.generator, seq.logprobs = None, None, []
        chunks.append(replace(chunk, seq=seq))
    return replace(plan, chunks=chunks)


class RankedWorkers(Worker):
    """Rank 0's ``ModelWorker`` plus ranks 1.. in spawned processes; see the module docstring."""

    def __init__(self, config, registry, model_cls: type[CausalLM], hf_config, source, device: torch.device,
                 dtype: torch.dtype, max_model_len: int, quant=None, structured=None) -> None:
        self.world = config.world_size
        self.timeout_s = config.distributed_timeout_s
        self._dir = tempfile.mkdtemp(prefix="armillary-tp-")
        self.reported: dict[int, str] = {}
        launched = launched_rank()  # its world the engine checked against config.world_size
        self.launched = launched is not None
        if launched is not None:  # the launcher started every rank; the others wait in follow_rank_zero
            if launched.rank != 0:
                raise ValueError(f"rank {launched.rank} builds no engine: it runs follow_rank_zero")
            init, self.errors, self.procs = "env://", None, []
        else:
            init = "file://" + os.path.join(self._dir, "rendezvous")
            ctx = mp.get_context("spawn")  # a fresh interpreter per rank: no forked CUDA or Triton state
            self.errors = ctx.Queue()
            self.procs = [ctx.Process(target=_rank_main, name=f"armillary-tp{rank}", daemon=True,
                                      args=(rank, self.world, init, config, registry.recipe(), max_model_len,
                                            self.errors))
                          for rank in range(1, self.world)]
        for proc in self.procs:
            proc.start()
        try:
            self.control = init_groups(0, self.world, init, device, self.timeout_s)
            if self.launched:  # what the followers cannot work out alone
                dist.broadcast_object_list([max_model_len], src=0, group=self.control)
        except Exception as exc:
            failure = self._failure(exc)
            self.close(graceful=False)
            raise failure from exc
        self.local = ModelWorker(config, model_cls, hf_config, source, device, dtype, max_model_len,
                                 parallel=rank_context(0, config.tensor_parallel_size, config.expert_parallel_size),
                                 quant=quant, structured=structured)
        self.parallel = self.local.parallel
        log.info("%d ranks (tensor-parallel %d, expert-parallel %d, %s)", self.world, config.tensor_parallel_size,
                 config.expert_parallel_size, dist.get_backend())

    # rank 0's model and step machinery, which the engine reads
    @property
    def model(self) -> CausalLM | None:
        return self.local.model

    @property
    def runner(self):
        return self.local.runner

    @property
    def caches(self):
        return self.local.caches

    @property
    def states(self):
        return self.local.states

    def load_model(self) -> CausalLM:
        self._send(LOAD)
        return self._run(self.local.load_model)

    def cache_budget(self, layout: list[LayerCacheSpec | None]) -> int:
        self._send(BUDGET, layout)
        budgets = [None] * self.world
        mine = self._run(lambda: self.local.cache_budget(layout))
        self._run(lambda: dist.all_gather_object(budgets, mine, group=self.control))
        return min(budgets)

    def init_caches(self, layout: list[LayerCacheSpec | None], plan: MemoryPlan, num_drafts: int = 0,
                    main_layers: int | None = None) -> None:
        self._send(CACHES, (layout, plan, num_drafts, main_layers))
        self._run(lambda: self.local.init_caches(layout, plan, num_drafts, main_layers))

    def apply_kv_scales(self, layout: list[LayerCacheSpec | None], calibration_tokens: int, vocab_size: int,
                        block_size: int, dtype: torch.dtype) -> str:
        args = (layout, calibration_tokens, vocab_size, block_size, dtype)
        self._send(KV_SCALES, args)
        return self._run(lambda: self.local.apply_kv_scales(*args))  # a calibration's forward runs on every rank

    def launch(self, plan: StepPlan) -> LaunchedStep:
        self._send(LAUNCH, portable_plan(plan))
        return self._run(lambda: self.local.launch(plan))

    def check_health(self) -> None:
        self._run(self._check_ranks)  # a dead rank: the others stopped, the groups left, RankFailed naming it

    def close(self, graceful: bool = True) -> None:
        """Stop the other ranks (a stop command unless not ``graceful``, then terminate what still runs) and
        leave the groups."""
        if graceful and (self.launched or any(p.is_alive() for p in self.procs)) and dist.is_initialized():
            try:
                self._send(STOP)
            except RankFailed:
                pass
        for proc in self.procs:
            proc.join(timeout=10 if graceful else 0)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        self.procs = []
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(self._dir, ignore_errors=True)

    # ---- failures

    def _send(self, command: str, payload=None) -> None:
        self._run(self._check_ranks)
        self._run(lambda: dist.broadcast_object_list([(command, payload)], src=0, group=self.control))

    def _run(self, fn):
        """``fn()``; a collective's failure (a rank gone, a timeout) becomes ``RankFailed`` naming the rank.
        Any failure stops the other ranks and leaves the groups: the process can build another engine."""
        try:
            return fn()
        except RankFailed:
            self.close(graceful=False)
            raise
        except RuntimeError as exc:  # gloo / NCCL report a lost peer or a timeout as RuntimeError
            failure = self._failure(exc)
            self.close(graceful=False)
            raise failure from exc
        except BaseException:
            self.close(graceful=False)
            raise

    def _check_ranks(self) -> None:
        dead = [(rank, p.exitcode) for rank, p in enumerate(self.procs, 1) if not p.is_alive()]
        if dead:
            raise self._failure(None, dead)

    def _failure(self, exc: Exception | None, dead: list[tuple[int, int | None]] | None = None) -> RankFailed:
        while self.errors is not None:
            try:
                rank, text = self.errors.get_nowait()
            except queue.Empty:
                break
            self.reported[rank] = text
        dead = dead if dead is not None else [(r, p.exitcode) for r, p in enumerate(self.procs, 1) if not p.is_alive()]
        what = "; ".join(f"rank {r} exited with code {code}" for r, code in dead) or \
            f"a collective failed or waited past {self.timeout_s:g} s ({type(exc).__name__}: {exc})"
        tail = "".join(f"\nrank {r}: {text.strip().splitlines()[-1]}" for r, text in sorted(self.reported.items()))
        return RankFailed(f"the model's ranks stopped: {what}{tail}")


def _rank_main(rank: int, world: int, init: str, config, recipe, max_model_len: int, errors) -> None:
    """Rank ``rank``'s spawned process: build what the engine built for rank 0, then follow rank 0's commands."""
    try:
        from armillary.registry import PluginRegistry

        torch.set_num_threads(max(1, torch.get_num_threads() // world))  # the ranks share the host's cores
        parts = _rank_parts(config, PluginRegistry.from_recipe(recipe), rank_device(config.torch_device(), rank))
        control = init_groups(rank, world, init, parts[-1], config.distributed_timeout_s)
        _follow(_rank_worker(config, rank, max_model_len, *parts), control, world)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def follow_rank_zero(config, registry) -> None:
    """A launched rank above 0 (``launched_rank``): join rank 0's group, build this rank's shard as rank 0's engine
    builds its own, and run rank 0's commands until it stops. Returns when rank 0 closes; raises on a failure."""
    launched = launched_rank()
    if launched is None or launched.rank == 0:
        raise ValueError("follow_rank_zero is for ranks above 0 that a launcher (torchrun) started")
    check_launched_world(config, launched)
    device = config.torch_device()
    if device.type == "cuda":
        device = torch.device("cuda", launched.local_rank)
    try:
        parts = _rank_parts(config, registry, device)
        control = init_groups(launched.rank, launched.world, "env://", device, config.distributed_timeout_s)
        box = [None]
        dist.broadcast_object_list(box, src=0, group=control)  # rank 0's max_model_len
        _follow(_rank_worker(config, launched.rank, box[0], *parts), control, launched.world)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _rank_parts(config, registry, device: torch.device) -> tuple:
    """(source, hf_config, architecture, quant config, device) of a rank other than 0, as rank 0's engine found
    them, with the kernel dispatch installed."""
    from armillary.kernels import ops
    from armillary.kernels.dispatch import resolve_dispatch
    from armillary.layers.quantization import resolve_quant_config
    from armillary.model_source import open_model_source
    from armillary.warmup import configure_compile_cache

    configure_compile_cache()
    registry.hook.armillary_startup(config=config)
    source = open_model_source(config.model, config.revision, registry, config)
    hf_config = source.hf_config()
    arch = registry.resolve_architecture(list(getattr(hf_config, "architectures", None) or []))
    ops.install(resolve_dispatch(registry, arch.name, device, config.kernel_backend))
    return source, hf_config, arch, resolve_quant_config(hf_config, registry, config.quantization), device


def _rank_worker(config, rank: int, max_model_len: int, source, hf_config, arch, quant, device) -> ModelWorker:
    from armillary.model_files import checkpoint_dtype

    return ModelWorker(config, arch.load(), hf_config, source, device, config.torch_dtype(checkpoint_dtype(hf_config)),
                       max_model_len, parallel=rank_context(rank, config.tensor_parallel_size,
                                                            config.expert_parallel_size), quant=quant)


def _follow(worker: ModelWorker, control, world: int) -> None:
    """Run rank 0's broadcast commands until it says stop."""
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=control)
        command, payload = box[0]
        if command == STOP:
            return
        if command == LOAD:
            worker.load_model()
        elif command == BUDGET:
            dist.all_gather_object([None] * world, worker.cache_budget(payload), group=control)
        elif command == CACHES:
            worker.init_caches(*payload)
        elif command == KV_SCALES:
            worker.apply_kv_scales(*payload)
        elif command == LAUNCH:
            worker.launch(payload).wait()
        else:
            raise ValueError(f"unknown command {command!r} from rank 0")
