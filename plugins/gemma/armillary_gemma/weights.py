"""Checkpoint names -> parameters, for the layouts Gemma ships in: ``*ForCausalLM`` (``model.*``) and the
multimodal ``*ForConditionalGeneration`` served text-only (``model.language_model.*``, or the older
``language_model.model.*``), whose vision / audio towers are skipped with one log line."""
from __future__ import annotations

import logging
import re

log = logging.getLogger(__name__)

_RENAMES = (("model.language_model.", "model."), ("language_model.model.", "model."),
            ("language_model.lm_head.", "lm_head."))
# towers and projectors of the multimodal checkpoints (Gemma 3: SigLIP; Gemma 4: vision and audio)
_TOWERS = re.compile(r"^(model\.)?(vision_tower|multi_modal_projector|embed_vision|audio_tower|embed_audio|"
                     r"vision_embedder)\.")
_SHARED_KV = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.")


def text_name(name: str) -> str | None:
    """The language model's parameter name for a checkpoint tensor; None for a multimodal tower's."""
    if _TOWERS.match(name):
        return None
    for old, new in _RENAMES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def unused_shared_kv(name: str, shared_layers: set[int]) -> bool:
    """Key / value weights a checkpoint may keep for KV-shared layers, which never use them."""
    m = _SHARED_KV.match(name)
    return m is not None and int(m.group(1)) in shared_layers


class SkipLog:
    """Counts skipped tensors per reason; ``report()`` logs one line per reason."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def skip(self, reason: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1

    def report(self) -> None:
        for reason, n in self.counts.items():
            log.info("skipped %d checkpoint tensor%s: %s", n, "" if n == 1 else "s", reason)
