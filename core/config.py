"""Engine configuration: vLLM's argument names."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used, so `armillary serve` checks its flags in a blink
    import torch

# dtype names -> torch attribute names
_DTYPES = {"float32": "float32", "fp32": "float32", "float": "float32",
           "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16", "half": "float16"}
DTYPE_CHOICES = ("auto", *_DTYPES)
LOAD_FORMATS = ("auto", "dummy")
KERNEL_BACKENDS = ("auto", "reference", "triton")  # armillary.kernels.ops._BACKENDS
GENERATION_CONFIG_CHOICES = ("auto", "vllm")  # or a folder holding a generation_config.json
# --quantization values naming the checkpoint's own format (armillary.layers.quantization.context.CHECKPOINT_FORMATS)
CHECKPOINT_QUANTIZATIONS = ("modelopt", "modelopt_fp4", "modelopt_mixed", "compressed-tensors")
SCHEDULING_POLICIES = ("fcfs", "slai")  # slai: prefill chunks sized to keep decodes under tbt_deadline_ms


@dataclass(slots=True)
class EngineConfig:
    model: str
    tokenizer: str | None = None  # defaults to the model directory
    max_model_len: int | None = None  # None: the checkpoint's limit
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # token budget of one step (decodes + prefill chunks); None: by device
    scheduling_policy: str = "fcfs"  # fcfs, or slai: deadline-aware prefill chunks (Atlas's --scheduling-policy)
    tbt_deadline_ms: float = 50.0  # slai: the inter-token latency running streams are kept under
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_space_gb: float = 4.0  # the KV + state budget when running on the CPU
    num_kv_blocks: int | None = None  # override the planner (tests use it to force preemption)
    enable_prefix_caching: bool = False  # reuse cached prompt prefixes (blocks and, on hybrid models, state snapshots)
    state_checkpoint_interval: int = 256  # prefix caching: recurrent-state snapshot every this many tokens
    num_state_snapshots: int = 0  # recurrent-state snapshot rows beside the slots; 0 with prefix caching: auto
    speculative: bool = False  # draft tokens with the checkpoint's MTP head and verify them (Atlas's --speculative)
    num_drafts: int = 2  # draft tokens per step when speculative (Atlas's --num-drafts; vLLM num_speculative_tokens)
    speculative_force_accept: bool = False  # benchmarks only: accept every draft (tokens are then wrong)
    quantization: str | None = None  # None: the checkpoint's quantization_config; "fp8" / "nvfp4": quantize a bf16 checkpoint online
    kv_cache_dtype: str = "auto"  # auto: the model dtype; fp8 (e4m3 with per-layer scales)
    kv_high_precision_layers: str = "auto"  # with an fp8 KV cache: attention layers kept in the model dtype
    fp8_kv_calibration_tokens: int = 0  # with an fp8 KV cache and no checkpoint scales: calibrate over this many tokens
    dtype: str = "auto"  # auto: the dtype config.json names
    seed: int = 0
    device: str = "auto"  # auto: cuda if available else cpu
    load_format: str = "auto"  # "dummy": random weights from config.json alone (benchmarks)
    enforce_eager: bool = False  # no CUDA graphs
    kernel_backend: str = "auto"  # "reference": torch kernels on CUDA too (the oracle); "triton": Triton everywhere
    max_graph_batch: int = 256  # largest decode batch captured in a CUDA graph
    async_scheduling: bool | None = None  # launch the next decode before reading tokens back; None: on CUDA
    warmup: bool = True  # at start-up, run the prefill sizes, sampler paths and a grammar once (armillary.warmup)
    revision: str | None = None
    chat_template: str | None = None  # a .jinja file or inline template: replaces the checkpoint's template
    generation_config: str = "auto"  # auto: the checkpoint's generation_config.json; vllm: none; or a folder
    download_dir: str | None = None  # the Hugging Face cache folder to look in (default: HF_HUB_CACHE / HF_HOME)
    tensor_parallel_size: int = 1  # ranks one model is split over (one process each; gloo on CPU, NCCL on GPUs)
    expert_parallel_size: int = 1  # ranks the MoE experts are split over, whole: 1, the TP size, or with TP 1 any
    distributed_timeout_s: float = 120.0  # a collective or a rank's reply waits this long before the engine fails
    plugin_args: dict = field(default_factory=dict)  # values of flags plugins added (armillary_add_cli_args)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first field a user set to something that cannot work.

        Cheap (no torch, no files but the ones named), so a server checks its flags before loading.
        """
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "seed", "max_graph_batch",
                     "tensor_parallel_size", "expert_parallel_size"):
            value = getattr(self, name)
            if value is None and name == "max_num_batched_tokens":
                continue  # chosen by device at start-up (resolve_token_budget)
            if not isinstance(value, int) or value < (0 if name == "seed" else 1):
                raise ValueError(f"{name} must be an integer of at least {0 if name == 'seed' else 1}, not {value!r}")
        for name in ("max_model_len", "num_kv_blocks"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, not {value!r}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, not {self.block_size}")
        if not (isinstance(self.distributed_timeout_s, (int, float)) and self.distributed_timeout_s > 0):
            raise ValueError(f"distributed_timeout_s must be a positive number of seconds, not {self.distributed_timeout_s!r}")
        tp, ep = self.tensor_parallel_size, self.expert_parallel_size
        if ep > 1 and tp > 1 and ep != tp:
            raise ValueError(f"expert_parallel_size {ep} must be 1, the tensor_parallel_size ({tp}: the experts split "
                             f"over the same ranks), or run with tensor_parallel_size 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], not {self.gpu_memory_utilization}")
        if not self.cpu_kv_cache_space_gb > 0:
            raise ValueError(f"cpu_kv_cache_space_gb must be positive, not {self.cpu_kv_cache_space_gb}")
        if str(self.dtype).removeprefix("torch.") not in DTYPE_CHOICES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; choose one of {', '.join(DTYPE_CHOICES)}")
        for name, choices in (("load_format", LOAD_FORMATS), ("kernel_backend", KERNEL_BACKENDS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {', '.join(choices)}, not {getattr(self, name)!r}")
        device = self.device.split(":")
        if device[0] not in ("auto", "cpu", "cuda") or len(device) > 2 or (
                len(device) == 2 and (device[0] != "cuda" or not device[1].isdigit())):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, not {self.device!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, not "
                             f"{self.scheduling_policy!r}")
        if not (isinstance(self.tbt_deadline_ms, (int, float)) and self.tbt_deadline_ms > 0):
            raise ValueError(f"tbt_deadline_ms must be a positive number of milliseconds, not {self.tbt_deadline_ms!r}")
        if self.generation_config not in GENERATION_CONFIG_CHOICES:
            folder = Path(self.generation_config).expanduser()
            if not (folder / "generation_config.json").is_file():
                raise ValueError(f"generation_config must be auto, vllm or a folder holding a "
                                 f"generation_config.json; {str(folder)!r} holds none")
        if self.speculative and not (isinstance(self.num_drafts, int) and 1 <= self.num_drafts <= 3):
            raise ValueError(f"num_drafts must be 1, 2 or 3 with speculative decoding, not {self.num_drafts!r}")
        interval = self.state_checkpoint_interval
        if not isinstance(interval, int) or interval < 1 or interval % self.block_size:
            raise ValueError(f"state_checkpoint_interval must be a positive multiple of block_size "
                             f"({self.block_size}), not {interval!r}")
        if not isinstance(self.num_state_snapshots, int) or self.num_state_snapshots < 0:
            raise ValueError(f"num_state_snapshots must be an integer of at least 0, not {self.num_state_snapshots!r}")
        if self.quantization not in (None, "fp8", "fp8_block", "nvfp4", *CHECKPOINT_QUANTIZATIONS):
            raise ValueError(f"quantization must be fp8 (per-channel), fp8_block (128 x 128) or nvfp4 for online "
                             f"quantization, or the checkpoint's own format ({', '.join(CHECKPOINT_QUANTIZATIONS)}), "
                             f"not {self.quantization!r}")
        if self.kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3"):
            raise ValueError(f"kv_cache_dtype must be auto, fp8 or fp8_e4m3, not {self.kv_cache_dtype!r}")
        hp = str(self.kv_high_precision_layers).replace(" ", "")
        if hp != "auto" and not (hp.strip(",") and all(p.isdigit() for p in hp.strip(",").split(","))):
            raise ValueError(f"kv_high_precision_layers must be auto, a count N, or layer indices i,j (one: i,); "
                             f"not {self.kv_high_precision_layers!r}")
        if not isinstance(self.fp8_kv_calibration_tokens, int) or self.fp8_kv_calibration_tokens < 0:
            raise ValueError(f"fp8_kv_calibration_tokens must be a non-negative integer, not "
                             f"{self.fp8_kv_calibration_tokens!r}")

    @property
    def world_size(self) -> int:
        """Processes one model runs over: tensor- and expert-parallel ranks are the same processes."""
        return max(self.tensor_parallel_size, self.expert_parallel_size)

    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolve_token_budget(self, device: torch.device) -> int:
        """Fill in an unset ``max_num_batched_tokens`` for ``device`` and return it.

        16,384 on GPUs of at least 70 GiB (vLLM's offline default there: a 16K prompt in one step, since each
        eager prefill step pays a fixed launch cost), 8,192 on smaller GPUs, 2,048 on the CPU."""
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = default_token_budget(device)
        return self.max_num_batched_tokens

    def torch_dtype(self, checkpoint_dtype: str | None) -> torch.dtype:
        import torch

        name = self.dtype if self.dtype != "auto" else (checkpoint_dtype or "bfloat16")
        try:
            return getattr(torch, _DTYPES[str(name).removeprefix("torch.")])
        except KeyError:
            raise ValueError(f"unsupported dtype {name!r}; choose one of {sorted(_DTYPES)}") from None


def default_token_budget(device: torch.device) -> int:
    """The step token budget an unset ``max_num_batched_tokens`` gets on ``device`` (EngineConfig.resolve_token_budget)."""
    if device.type != "cuda":
        return 2048
    import torch

    total = torch.cuda.get_device_properties(device).total_memory
    return 16384 if total >= 70 * 2**30 else 8192
