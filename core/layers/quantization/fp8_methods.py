"""FP8 (e4m3) linear and MoE methods: block-scaled, per-channel or per-tensor (ModelOpt) weights as published, or quantized at load time.

A weight is fp8 ``[N, K]`` with fp32 scales ``[ceil(N / bn), ceil(K / bk)]`` (dequantize by
multiplying; per-channel is the block (1, K)). The scale's parameter name is the checkpoint's:
``weight_scale_inv`` (Qwen / DeepSeek ``quant_method: fp8``) or ``weight_scale``
(compressed-tensors). Activations are quantized at run time per token and group of 128 columns
inside the Triton GEMM; the CPU path dequantizes the weight (``armillary.kernels.fp8``).

A stacked layer whose trailing slots are not on block edges (Qwen3.5's GDN ``in_proj`` rows
[q | k | v | z | b | a], where the 32-row b and a are left unquantized in the checkpoint) keeps
those slots in the params dtype as ``weight_tail``, which ``ops.fp8_linear`` writes into the same output.
"""
from __future__ import annotations

import torch
from torch import nn

from armillary.errors import WeightLoadError
from armillary.kernels import ops
from armillary.kernels.fp8 import FP8_DTYPE, quantize_blocks
from armillary.layers.quantization.base import FusedMoEMethod, QuantMethod, per_tensor_scale_loader, register_weight


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def fp8_slot_count(sizes: list[int], block_n: int) -> int:
    """How many leading slots of a stacked layer (rows ``sizes``) can share block scales: each must
    start on a block edge and fill whole blocks, except the very last slot of the layer."""
    start = 0
    for i, size in enumerate(sizes):
        last = i == len(sizes) - 1
        if start % block_n or (size % block_n and not last):
            return i
        start += size
    return len(sizes)


class Fp8LinearMethod(QuantMethod):
    """``weight`` fp8 [N, K] and ``<scale_name>`` fp32 [ceil(N / bn), ceil(K / bk)] from the checkpoint.

    ``block``: (bn, bk); per-channel is (1, None) (one scale per row, ``[N, 1]``).
    """

    def __init__(self, block: tuple[int, int | None], scale_name: str = "weight_scale_inv") -> None:
        self.block_n, self.block_k_or_row = block
        self.scale_name = scale_name

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype) -> None:
        bn = self.block_n
        bk = self.block_k_or_row or input_size  # per-channel: the whole row
        layer.fp8_block = (bn, bk)
        if self.block_k_or_row and input_size_per_partition % bk and input_size_per_partition != input_size:
            raise ValueError(f"{layer.prefix}: {input_size_per_partition} input columns per rank are not whole "
                             f"fp8 blocks of {bk}")
        nslots = fp8_slot_count(output_partition_sizes, bn)
        rows = sum(output_partition_sizes)
        layer.fp8_rows = sum(output_partition_sizes[:nslots])
        if nslots == 0:
            raise ValueError(f"{layer.prefix}: output slots {output_partition_sizes} do not start on fp8 blocks of "
                             f"{bn} rows")
        weight = register_weight(layer, "weight", torch.empty(rows, input_size_per_partition, dtype=FP8_DTYPE),
                                 output_dim=0, input_dim=1)
        scale = torch.empty(_cdiv(layer.fp8_rows, bn), _cdiv(input_size_per_partition, bk), dtype=torch.float32)
        register_weight(layer, self.scale_name, scale, output_dim=0, input_dim=1 if self.block_k_or_row else None,
                        output_block=bn, input_block=bk)
        layer.fp8_tail_slots = set(range(nslots, len(output_partition_sizes)))
        if layer.fp8_rows < rows:  # unquantized tail slots: their rows of `weight` only count them as loaded
            layer.register_buffer("weight_tail", torch.zeros(rows - layer.fp8_rows, input_size_per_partition,
                                                             dtype=params_dtype))
        weight.weight_loader = _fp8_weight_loader(layer)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if layer.fp8_rows < layer.weight.shape[0]:  # drop the placeholder rows of the tail
            layer.weight = nn.Parameter(layer.weight.data[: layer.fp8_rows].clone(), requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        bn, bk = layer.fp8_block
        out = ops.fp8_linear(x2, layer.weight, getattr(layer, self.scale_name), bn, bk, bias,
                             getattr(layer, "weight_tail", None))  # [M, N_fp8 + N_tail]
        return out.view(*lead, out.shape[-1])


def _fp8_weight_loader(layer: nn.Module):
    """The layer's loader for ``weight``: fp8 checkpoint tensors only, the unquantized tail slots
    routed into ``weight_tail``."""
    base = layer.weight_loader

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None):
        if shard_id is None or layer._shard_index(shard_id) not in layer.fp8_tail_slots:
            if loaded.dtype != FP8_DTYPE:
                raise WeightLoadError(f"{layer.prefix}.weight: the checkpoint tensor is {loaded.dtype}, this fp8 "
                                      "layer takes float8_e4m3fn (is it in modules_to_not_convert / ignore?)")
            return base(param, loaded, shard_id)
        if loaded.dtype == FP8_DTYPE:
            raise WeightLoadError(f"{layer.prefix}.weight shard {shard_id!r}: rows off the fp8 block grid need an "
                                  "unquantized checkpoint tensor (dequantize it before loading)")
        (full, rows, dst, src), = layer._slots(shard_id)
        holder = _TailView(layer.weight_tail)
        layer._load_slot(holder.param, loaded, (full, rows, dst - layer.fp8_rows, src), 0, 1, f"{layer.prefix}.weight")
        return (slice(dst, dst + rows),)  # rows of `weight` this slot stands for

    return load


def _fp8_only_loader(layer: nn.Module, base):
    """An expert weight loader that refuses unquantized checkpoint tensors (a silent cast would drop the scale)."""

    def load(param: nn.Parameter, loaded: torch.Tensor, *args, **kwargs):
        if loaded.dtype != FP8_DTYPE:
            raise WeightLoadError(f"{layer.prefix}: an expert weight of the checkpoint is {loaded.dtype}, this fp8 "
                                  "layer takes float8_e4m3fn (is it in modules_to_not_convert / ignore?)")
        return base(param, loaded, *args, **kwargs)

    return load


class _TailView:
    """``weight_tail`` as a parameter-like target for the layer's slot loader (no input slicing attrs)."""

    def __init__(self, tail: torch.Tensor) -> None:
        self.param = nn.Parameter(tail, requires_grad=False)  # shares storage with the buffer
        self.param.input_dim, self.param.input_block = 1, 1


class OnlineFp8LinearMethod(QuantMethod):
    """``--quantization fp8``: ``weight`` loaded in the params dtype, quantized after loading to fp8
    with scales per output row (``block`` None) or per (bn, bk) block; then as ``Fp8LinearMethod``."""

    def __init__(self, block: tuple[int, int] | None = None) -> None:
        self.block = block

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype) -> None:
        weight = torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype)
        register_weight(layer, "weight", weight, output_dim=0, input_dim=1)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        bn, bk = self.block or (1, layer.weight.shape[1])
        q, scale = quantize_blocks(layer.weight.data, bn, bk)
        layer.weight = nn.Parameter(q, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)
        layer.fp8_block = (bn, bk)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        lead = x.shape[:-1]
        out = ops.fp8_linear(x.reshape(-1, x.shape[-1]), layer.weight, layer.weight_scale, *layer.fp8_block, bias)
        return out.view(*lead, out.shape[-1])


class Fp8MoEMethod(FusedMoEMethod):
    """Stacked fp8 experts: ``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I] and their scales
    ``gate_up_proj_<scale_name>`` [E, ceil(2I / bn), ceil(H / bk)], ``down_proj_<scale_name>``
    [E, ceil(H / bn), ceil(I / bk)] (per-channel: [E, 2I, 1] and [E, H, 1]).

    ``online``: experts loaded in the params dtype and quantized after loading instead.
    """

    def __init__(self, block: tuple[int, int | None], scale_name: str = "weight_scale_inv",
                 online: bool = False) -> None:
        self.block_n, self.block_k = block
        self.scale_name, self.online = scale_name, online

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype) -> None:
        inter, bn = intermediate_size_per_partition, self.block_n
        rows = (2 if layer.gated else 1) * inter
        bk = self.block_k or max(hidden_size, inter)  # per-channel: any k // bk is column 0
        layer.fp8_block = (bn, bk)
        dtype = params_dtype if self.online else FP8_DTYPE
        w13 = register_weight(layer, "gate_up_proj", torch.empty(num_experts, rows, hidden_size, dtype=dtype),
                              moe_dim=1)
        w2 = register_weight(layer, "down_proj", torch.empty(num_experts, hidden_size, inter, dtype=dtype), moe_dim=2)
        if self.online:
            return
        for param in (w13, w2):
            param.weight_loader = _fp8_only_loader(layer, param.weight_loader)
        if inter % bn or (self.block_k and inter % self.block_k and layer.tp_size > 1):
            raise ValueError(f"{layer.prefix}: an intermediate size of {inter} per rank is not whole fp8 blocks of "
                             f"{bn} rows")
        if self.block_k:  # block-wise: scales along the intermediate dimension are sharded like the weight
            s13 = torch.empty(num_experts, _cdiv(rows, bn), _cdiv(hidden_size, bk), dtype=torch.float32)
            s2 = torch.empty(num_experts, _cdiv(hidden_size, bn), _cdiv(inter, bk), dtype=torch.float32)
            register_weight(layer, f"gate_up_proj_{self.scale_name}", s13, moe_dim=1, moe_block=bn)
            register_weight(layer, f"down_proj_{self.scale_name}", s2, moe_dim=2, moe_block=bk)
        else:  # per-channel: one scale per output row
            register_weight(layer, f"gate_up_proj_{self.scale_name}",
                            torch.empty(num_experts, rows, 1, dtype=torch.float32), moe_dim=1)
            register_weight(layer, f"down_proj_{self.scale_name}",
                            torch.empty(num_experts, hidden_size, 1, dtype=torch.float32))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not self.online:
            for base in ("gate_up_proj", "down_proj"):
                if getattr(layer, base).dtype != FP8_DTYPE:
                    raise WeightLoadError(f"{layer.prefix}.{base}: not float8_e4m3fn after loading")
            return
        bn, bk = layer.fp8_block
        for base in ("gate_up_proj", "down_proj"):
            q, scale = quantize_blocks(getattr(layer, base).data, bn, bk)
            setattr(layer, base, nn.Parameter(q, requires_grad=False))
            setattr(layer, f"{base}_{self.scale_name}", nn.Parameter(scale, requires_grad=False))

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        bn, bk = layer.fp8_block
        return ops.fp8_fused_moe(x, layer.gate_up_proj, getattr(layer, f"gate_up_proj_{self.scale_name}"),
                                 layer.down_proj, getattr(layer, f"down_proj_{self.scale_name}"), bn, bk,
                                 topk_weights, topk_ids, layer.activation)


class Fp8PerTensorLinearMethod(Fp8LinearMethod):
    """ModelOpt ``FP8``: ``weight`` fp8 [N, K], one fp32 ``weight_scale`` (and static ``input_scale``) per
    checkpoint tensor, so per stacked shard; after loading the shard scales become per-channel scales
    [N, 1] (exact: each row keeps its tensor's scale) and the layer runs as ``Fp8LinearMethod`` per channel,
    activations quantized dynamically (``input_scale`` is kept but not needed)."""

    def __init__(self) -> None:
        super().__init__((1, None), "weight_scale")

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype) -> None:
        super().create_weights(layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                               params_dtype)
        for name in ("weight_scale", "input_scale"):
            p = register_weight(layer, name, torch.empty(len(output_partition_sizes), dtype=torch.float32),
                                per_shard=True)
            p.weight_loader = per_tensor_scale_loader(p.weight_loader)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        super().process_weights_after_loading(layer)
        sizes = torch.tensor(layer.output_partition_sizes, device=layer.weight_scale.device)
        rows = layer.weight_scale.data.repeat_interleave(sizes)[:, None]  # [N, 1]
        layer.weight_scale = nn.Parameter(rows.contiguous(), requires_grad=False)


class Fp8PerTensorMoEMethod(Fp8MoEMethod):
    """ModelOpt ``FP8`` experts: one fp32 ``weight_scale`` / ``input_scale`` per expert and projection
    (``gate_up_proj_weight_scale`` [E, 2, 1], ``down_proj_weight_scale`` [E, 1]); after loading per-channel
    scales [E, 2I, 1] / [E, H, 1] and ``Fp8MoEMethod`` per channel."""

    def __init__(self) -> None:
        super().__init__((1, None), "weight_scale")

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype) -> None:
        super().create_weights(layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype)
        shards = 2 if layer.gated else 1
        for attr in ("weight_scale", "input_scale"):
            for name, data, kw in ((f"gate_up_proj_{attr}", torch.empty(num_experts, shards, 1), dict(per_shard=True)),
                                   (f"down_proj_{attr}", torch.empty(num_experts, 1), {})):
                p = register_weight(layer, name, data.float(), **kw)
                p.weight_loader = per_tensor_scale_loader(p.weight_loader)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        super().process_weights_after_loading(layer)
        inter = layer.intermediate_size_per_partition
        s13 = layer.gate_up_proj_weight_scale.data.reshape(layer.gate_up_proj.shape[0], -1)  # [E, shards]
        s2 = layer.down_proj_weight_scale.data  # [E, 1]
        layer.gate_up_proj_weight_scale = nn.Parameter(s13.repeat_interleave(inter, dim=1)[..., None].contiguous(),
                                                       requires_grad=False)  # [E, 2I, 1]
        layer.down_proj_weight_scale = nn.Parameter(s2.expand(-1, layer.hidden_size)[..., None].contiguous(),
                                                    requires_grad=False)  # [E, H, 1]
