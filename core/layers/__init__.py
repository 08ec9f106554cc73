"""Shared layers plugins build models from: parallel linears, fused MoE, norms, embedding, each with weight loaders.

A plugin builds its modules from these instead of raw parameters; the worker builds the model
inside ``use_parallel(...)`` and ``use_quant_config(...)``, loads it (``CheckpointLoader`` under
the model's ``load_weights``) and then calls ``process_weights_after_loading(model)``.
"""
from __future__ import annotations

from armillary.layers.embedding import LMHead, VocabEmbedding
from armillary.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from armillary.layers.loading import (
    CheckpointLoader,
    LoadedRows,
    copy_checked,
    default_weight_loader,
    process_weights_after_loading,
)
from armillary.layers.mlp import GatedMLP
from armillary.layers.moe import FusedMoE
from armillary.layers.norm import GatedRMSNorm, RMSNorm

__all__ = [
    "LMHead", "VocabEmbedding", "ColumnParallelLinear", "LinearBase", "MergedColumnParallelLinear",
    "QKVParallelLinear", "ReplicatedLinear", "RowParallelLinear", "CheckpointLoader", "LoadedRows", "copy_checked",
    "default_weight_loader", "process_weights_after_loading", "GatedMLP", "FusedMoE", "GatedRMSNorm", "RMSNorm",
]
