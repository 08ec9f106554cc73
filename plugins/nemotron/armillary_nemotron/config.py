"""The ``nemotron_h`` config.json fields the model reads, checked once (both spellings transformers has used)."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from armillary.hf_config import HFConfig

logger = logging.getLogger(__name__)

MAMBA, MOE, ATTENTION, MLP = "mamba", "moe", "attention", "mlp"
_PATTERN = {"M": MAMBA, "E": MOE, "*": ATTENTION, "-": MLP}
_BLOCK_TYPES = {"linear_attention": MAMBA, "mamba": MAMBA, "moe": MOE, "full_attention": ATTENTION,
                "attention": ATTENTION, "mlp": MLP}


def _get(hf: HFConfig, names: tuple[str, ...], default=None):
    """The first of ``names`` config.json sets (newer name first, then the legacy ``mamba_*`` ones)."""
    for name in names:
        value = getattr(hf, name, None)
        if value is not None:
            return value
    return default


def layer_kinds(hf: HFConfig) -> list[str]:
    """Per layer: mamba | moe | attention | mlp, from ``layers_block_type`` or ``hybrid_override_pattern``."""
    listed = getattr(hf, "layers_block_type", None)
    if listed:
        unknown = sorted(set(listed) - set(_BLOCK_TYPES))
        if unknown:
            raise ValueError(f"config.json layers_block_type has unknown types {unknown}")
        return [_BLOCK_TYPES[t] for t in listed]
    pattern = getattr(hf, "hybrid_override_pattern", None)
    if not pattern:
        raise ValueError("config.json sets neither layers_block_type nor hybrid_override_pattern")
    unknown = sorted(set(pattern) - set(_PATTERN))
    if unknown:
        raise ValueError(f"config.json hybrid_override_pattern has unknown layer letters {unknown}")
    return [_PATTERN[c] for c in pattern]


def mtp_layer_kinds(hf: HFConfig) -> tuple[str, ...]:
    """The MTP head's sublayers (mamba | moe | attention | mlp), empty when ``num_nextn_predict_layers`` is 0:
    ``mtp_layers_block_type`` (transformers 5), else ``mtp_hybrid_override_pattern`` (NVIDIA's config.json,
    Nemotron-3 Super: ``"*E"``), else transformers' default attention + MoE."""
    if not int(getattr(hf, "num_nextn_predict_layers", 0) or 0):
        return ()
    listed = getattr(hf, "mtp_layers_block_type", None)
    if listed:
        unknown = sorted(set(listed) - set(_BLOCK_TYPES))
        if unknown:
            raise ValueError(f"config.json mtp_layers_block_type has unknown types {unknown}")
        return tuple(_BLOCK_TYPES[t] for t in listed)
    pattern = getattr(hf, "mtp_hybrid_override_pattern", None) or "*E"
    unknown = sorted(set(pattern) - set(_PATTERN))
    if unknown:
        raise ValueError(f"config.json mtp_hybrid_override_pattern has unknown layer letters {unknown}")
    return tuple(_PATTERN[c] for c in pattern)


@dataclass(frozen=True, slots=True)
class NemotronHArgs:
    kinds: tuple[str, ...]
    vocab_size: int
    hidden_size: int
    eps: float
    tie_word_embeddings: bool
    # attention
    num_heads: int
    num_kv_heads: int
    head_dim: int
    # dense MLP
    intermediate_size: int
    mlp_act: str
    mlp_bias: bool
    # Mamba-2
    mamba_heads: int
    mamba_head_dim: int
    n_groups: int
    state_size: int
    conv_kernel: int
    conv_bias: bool
    mamba_proj_bias: bool
    chunk_size: int
    dt_min: float  # softplus(dt + dt_bias) is clamped from below by this (transformers' time_step_limit)
    # MoE
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    shared_intermediate_size: int
    routed_scaling_factor: float
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    max_position_embeddings: int
    # MTP head (Nemotron-3 Super): its sublayers, and how many times the checkpoint stacks them
    mtp_kinds: tuple[str, ...] = ()
    mtp_steps: int = 0

    @property
    def d_inner(self) -> int:
        return self.mamba_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: x (d_inner) ‖ B ‖ C (n_groups · state each)."""
        return self.d_inner + 2 * self.n_groups * self.state_size

    @classmethod
    def parse(cls, hf: HFConfig) -> NemotronHArgs:
        kinds = tuple(layer_kinds(hf))
        if getattr(hf, "moe_latent_size", None) is not None:
            raise ValueError("config.json sets moe_latent_size (latent MoE projections, Nemotron-3 Super), "
                             "which this plugin does not implement yet")
        if getattr(hf, "attention_bias", False):
            logger.warning("config.json sets attention_bias, which nemotron_h attention ignores (as transformers "
                           "does): the q/k/v/o projections have no bias")
        if getattr(hf, "residual_in_fp32", False):
            logger.warning("config.json sets residual_in_fp32; the residual stream stays in the model dtype")
        if getattr(hf, "sliding_window", None):
            raise ValueError(f"config.json sets sliding_window={hf.sliding_window}, which nemotron_h attention "
                             "does not implement (transformers ignores it too); remove it")
        mamba_act = _get(hf, ("mamba_hidden_act",), "silu")
        if mamba_act not in ("silu", "swish"):
            raise ValueError(f"config.json mamba_hidden_act={mamba_act!r}: only silu is implemented")
        expand = _get(hf, ("expand", "mamba_expand"), 2)
        heads = hf.mamba_num_heads
        head_dim = _get(hf, ("mamba_head_dim",), None) or expand * hf.hidden_size // heads
        n_group = int(_get(hf, ("n_group",), 1))
        num_experts = int(_get(hf, ("n_routed_experts", "num_local_experts"), 0) or 0)
        if MOE in kinds and num_experts % n_group:
            raise ValueError(f"{num_experts} experts do not split into n_group={n_group} groups")
        return cls(
            kinds=kinds,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            eps=float(_get(hf, ("layer_norm_epsilon", "rms_norm_eps"), 1e-5)),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            num_heads=hf.num_attention_heads,
            num_kv_heads=_get(hf, ("num_key_value_heads",), hf.num_attention_heads),
            head_dim=_get(hf, ("head_dim",), None) or hf.hidden_size // hf.num_attention_heads,
            intermediate_size=int(_get(hf, ("intermediate_size",), 0)),
            mlp_act=_get(hf, ("mlp_hidden_act",), "relu2"),
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            mamba_heads=heads,
            mamba_head_dim=head_dim,
            n_groups=_get(hf, ("n_groups", "mamba_n_groups"), 1),
            state_size=hf.ssm_state_size,
            conv_kernel=_get(hf, ("conv_kernel", "mamba_d_conv"), 4),
            conv_bias=bool(_get(hf, ("use_conv_bias", "mamba_conv_bias"), True)),
            mamba_proj_bias=bool(getattr(hf, "use_bias", False)),  # transformers' in_proj / out_proj bias
            chunk_size=_get(hf, ("chunk_size", "mamba_chunk_size"), 128),
            dt_min=float(_get(hf, ("time_step_min", "mamba_dt_min"), 0.0)),
            num_experts=num_experts,
            top_k=int(_get(hf, ("num_experts_per_tok",), 1)),
            moe_intermediate_size=int(_get(hf, ("moe_intermediate_size",), 0)),
            shared_intermediate_size=int(_get(hf, ("moe_shared_expert_intermediate_size",), 0)),
            routed_scaling_factor=float(_get(hf, ("routed_scaling_factor",), 1.0)),
            n_group=n_group,
            topk_group=int(_get(hf, ("topk_group",), 1)),
            norm_topk_prob=bool(_get(hf, ("norm_topk_prob",), True)),
            max_position_embeddings=int(_get(hf, ("max_position_embeddings",), 4096)),
            mtp_kinds=mtp_layer_kinds(hf),
            mtp_steps=int(getattr(hf, "num_nextn_predict_layers", 0) or 0),
        )
