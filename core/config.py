"""Engine configuration: vLLM's argument names."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


@dataclass(slots=True)
class EngineConfig:
    model: str
    tokenizer: str | None = None  # defaults to the model directory
    max_model_len: int | None = None  # None: the checkpoint's limit
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # token budget of one step (decodes + prefill chunks)
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_space_gb: float = 4.0  # the KV + state budget when running on the CPU
    num_kv_blocks: int | None = None  # override the planner (tests use it to force preemption)
    enable_prefix_caching: bool = False  # reserved
    num_state_snapshots: int = 0  # recurrent-state snapshot rows kept beside the running slots
    dtype: str = "auto"  # auto: the dtype config.json names
    seed: int = 0
    device: str = "auto"  # auto: cuda if available else cpu
    load_format: str = "auto"  # "dummy": random weights from config.json alone (benchmarks)
    enforce_eager: bool = False  # no CUDA graphs
    kernel_backend: str = "auto"  # "reference": torch kernels on CUDA too (the oracle); "triton": Triton everywhere
    max_graph_batch: int = 256  # largest decode batch captured in a CUDA graph
    async_scheduling: bool | None = None  # launch the next decode before reading tokens back; None: on CUDA
    revision: str | None = None
    plugin_args: dict = field(default_factory=dict)  # values of flags plugins added (armillary_add_cli_args)

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self, checkpoint_dtype: str | None) -> torch.dtype:
        name = self.dtype if self.dtype != "auto" else (checkpoint_dtype or "bfloat16")
        try:
            return _DTYPES[str(name).removeprefix("torch.")]
        except KeyError:
            raise ValueError(f"unsupported dtype {name!r}; choose one of {sorted(_DTYPES)}") from None
