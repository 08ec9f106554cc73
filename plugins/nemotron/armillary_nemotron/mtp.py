"""The Nemotron-H MTP draft head (Nemotron-3 Super; checkpoint ``mtp.layers.{j}.*``), run by ``draft_forward``.

Layout (vLLM's ``nemotron_h_mtp.py``, TensorRT-LLM's ``NemotronHMTP`` and its weight mapper: "mtp.layers.0
is the attention sublayer, mtp.layers.1 the MoE"): the sublayers ``mtp_layers_block_type`` /
``mtp_hybrid_override_pattern`` lists (Super: ``*E``), each a Nemotron-H block (``norm`` + ``mixer``) on
one residual stream. The first also holds ``enorm`` (on the embedding of the next token), ``hnorm`` (on
the main model's final-normed hidden state) and ``eh_proj`` [H, 2H] over ``[enorm(e) ; hnorm(h)]``; the
last holds ``final_layernorm`` over the stream. The embedding and the LM head are the main model's (the
checkpoint has no copies). Each attention sublayer keeps its own KV cache (``draft_cache_layout``).

Mamba sublayers are refused: the draft passes run over positions a verify step may reject and drafts
that are not kept, which a KV cache overwrites by position but a recurrent state cannot undo, and core's
decode passes of the draft head carry no state slot (``DraftProposer._decode_batch``).
"""
from __future__ import annotations

import torch
from torch import nn

from armillary.cache_spec import FullAttention, LayerCacheSpec
from armillary.forward_batch import ForwardBatch
from armillary.layers import ReplicatedLinear, RMSNorm, VocabEmbedding
from armillary.parallel import get_parallel
from armillary_nemotron.block import NemotronHBlock
from armillary_nemotron.config import ATTENTION, MAMBA, NemotronHArgs


def mtp_unsupported(cfg: NemotronHArgs) -> str | None:
    """Why this config's MTP head cannot draft here, or None when it can (or has none)."""
    if not cfg.mtp_kinds:
        return None
    if cfg.mtp_steps > 1:
        return f"num_nextn_predict_layers={cfg.mtp_steps}: armillary drafts with one MTP layer (as vLLM does)"
    if MAMBA in cfg.mtp_kinds:
        return ("the MTP layers contain Mamba blocks: core's draft passes keep no recurrent state for the draft "
                "head (they run over rejected positions and one-token drafts a state could not roll back)")
    return None


def mtp_cache_layout(cfg: NemotronHArgs) -> list[LayerCacheSpec | None]:
    """Per MTP sublayer: a KV cache for attention, nothing for MoE / MLP."""
    attention = FullAttention(get_parallel().kv_heads(cfg.num_kv_heads), cfg.head_dim)  # this rank's heads
    return [attention if k == ATTENTION else None for k in cfg.mtp_kinds]


class MTPSublayer(NemotronHBlock):
    """A block of the MTP head; the first adds ``enorm`` / ``hnorm`` / ``eh_proj``, the last ``final_layernorm``."""

    def __init__(self, cfg: NemotronHArgs, kind: str, prefix: str, first: bool, last: bool) -> None:
        super().__init__(cfg, kind, prefix)
        if first:
            self.enorm = RMSNorm(cfg.hidden_size, cfg.eps)
            self.hnorm = RMSNorm(cfg.hidden_size, cfg.eps)
            self.eh_proj = ReplicatedLinear(2 * cfg.hidden_size, cfg.hidden_size, bias=False,
                                            prefix=f"{prefix}.eh_proj")
        if last:
            self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.eps)


class NemotronHMTP(nn.Module):
    """``layers`` named as the checkpoint's ``mtp.layers.{j}``."""

    def __init__(self, cfg: NemotronHArgs, prefix: str = "mtp") -> None:
        super().__init__()
        reason = mtp_unsupported(cfg)
        if reason is not None:
            raise NotImplementedError(reason)
        last = len(cfg.mtp_kinds) - 1
        self.layers = nn.ModuleList(MTPSublayer(cfg, kind, f"{prefix}.layers.{j}", j == 0, j == last)
                                    for j, kind in enumerate(cfg.mtp_kinds))

    def forward(self, batch: ForwardBatch, hidden: torch.Tensor, embed: VocabEmbedding) -> torch.Tensor:
        """input_ids [T] (the token after each position), hidden [T, H] -> final-normed draft hidden [T, H];
        ``batch.caches`` are the sublayers' caches in order."""
        first, last = self.layers[0], self.layers[-1]
        fused = torch.cat((first.enorm(embed(batch.input_ids)), first.hnorm(hidden)), dim=-1)  # [T, 2H]
        h, residual = first.eh_proj(fused), None
        for layer, cache in zip(self.layers, batch.caches):
            h, residual = layer(h, residual, batch, cache)
        return last.final_layernorm.add(h, residual)[0]
