"""The MTP draft head (``draft_forward``) against a plain-torch composition of the same weights: transformers'
own decoder layer for the MTP block, ``enorm`` / ``hnorm`` / ``eh_proj`` / ``shared_head.norm`` by hand.

The checkpoint is a 4-layer transformers model whose last layer becomes the MTP layer
(``model.layers.3.*`` with ``num_hidden_layers`` 3 and ``num_nextn_predict_layers`` 1), plus the
MTP-only tensors. End-to-end speculative decoding (K = 1, 2 equal to plain decoding) needs core's
speculative runner and is not covered here.
"""
from __future__ import annotations

import json

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file, save_file

from armillary.cache_spec import LatentAttention
from armillary.forward_batch import ForwardBatch, LatentCache
from armillary.testing import paged_batch
from plugins.glm_flash.tests.harness import Harness
from plugins.glm_flash.tests.hf_models import CASES, VOCAB

BLOCK = 4
MTP_ONLY = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "embed_tokens.weight",
            "shared_head.head.weight")


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    """(directory, transformers' 4-layer model): its layer 3 is the MTP block, the MTP-only tensors random."""
    return write_mtp_checkpoint(tmp_path_factory.mktemp("mtp"))


def write_mtp_checkpoint(directory, **overrides):
    """``mtp_checkpoint`` into ``directory``, CASES[0]'s config changed by ``overrides``."""
    torch.manual_seed(0)
    base = dict(CASES[0].config, num_hidden_layers=4, mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
                **overrides)
    hf = tf.Glm4MoeLiteForCausalLM._from_config(tf.Glm4MoeLiteConfig(**base), attn_implementation="eager",
                                                dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.3)
    hf.save_pretrained(directory)
    tensors = load_file(str(directory / "model.safetensors"))
    hidden = base["hidden_size"]
    extra = {"enorm.weight": 1 + 0.3 * torch.randn(hidden), "hnorm.weight": 1 + 0.3 * torch.randn(hidden),
             "eh_proj.weight": torch.randn(hidden, 2 * hidden) * 0.1,
             "shared_head.norm.weight": 1 + 0.3 * torch.randn(hidden),
             "embed_tokens.weight": tensors["model.embed_tokens.weight"],
             "shared_head.head.weight": tensors["lm_head.weight"]}
    tensors.update({f"model.layers.3.{k}": v.clone() for k, v in extra.items()})
    save_file(tensors, str(directory / "model.safetensors"))
    config = json.loads((directory / "config.json").read_text())
    config.update(num_hidden_layers=3, mlp_layer_types=base["mlp_layer_types"][:3], num_nextn_predict_layers=1)
    (directory / "config.json").write_text(json.dumps(config))
    return directory, hf, {k: v for k, v in extra.items() if k in MTP_ONLY[:4]}


def draft_batch(cache, rows: list[tuple[list[int], list[int], list[int], int]]) -> ForwardBatch:
    """rows: per sequence (new token ids, their positions, block table, cached tokens before them)."""
    return paged_batch([cache], rows, BLOCK)


@torch.no_grad()
def oracle(hf: tf.PreTrainedModel, extra: dict[str, torch.Tensor], next_ids: torch.Tensor, hidden: torch.Tensor,
           eps: float) -> torch.Tensor:
    """One sequence, positions 0..L-1: shared_head.norm(layer3(eh_proj([enorm(emb) ; hnorm(hidden)])))."""

    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    embedded = norm(hf.model.embed_tokens(next_ids), extra["enorm.weight"])
    x = torch.cat((embedded, norm(hidden, extra["hnorm.weight"])), -1)
    x = (x @ extra["eh_proj.weight"].T)[None]  # [1, L, H]
    length = x.shape[1]
    position_ids = torch.arange(length)[None]
    mask = torch.full((length, length), float("-inf")).triu(1)[None, None]
    y = hf.model.layers[3](x, attention_mask=mask, position_ids=position_ids,
                           position_embeddings=hf.model.rotary_emb(x, position_ids))
    return norm(y[0], extra["shared_head.norm.weight"])


@torch.no_grad()
def test_draft_forward_matches_plain_composition(mtp_checkpoint):
    directory, hf, extra = mtp_checkpoint
    harness = Harness(directory)
    model = harness.model
    assert model.draft_cache_layout(harness.engine.hf_config) == [LatentAttention(40, 12)]
    eps = model.config.rms_norm_eps
    gen = torch.Generator().manual_seed(7)
    tokens = [torch.randint(2, VOCAB, (n,), generator=gen) for n in (13, 6)]
    hidden = [torch.randn(len(t), 64, generator=gen) for t in tokens]  # stand-ins for the main model's hidden
    next_ids = [torch.randint(2, VOCAB, (len(t),), generator=gen) for t in tokens]
    cache = LatentCache(torch.zeros(16, BLOCK, 52))
    tables = [[3, 7, 1, 9, 12], [5, 2, 14]]
    # prefill: positions 0..n-2 of both sequences in one pass (a fresh prompt and a shorter one)
    pre = [len(t) - 1 for t in tokens]
    batch = draft_batch(cache, [(next_ids[s][:pre[s]].tolist(), list(range(pre[s])), tables[s], 0) for s in (0, 1)])
    out = model.draft_forward(batch, torch.cat([hidden[s][:pre[s]] for s in (0, 1)]))
    for s, (lo, hi) in enumerate(zip(batch.query_start_loc_cpu, batch.query_start_loc_cpu[1:])):
        want = oracle(hf, extra, next_ids[s][:pre[s]], hidden[s][:pre[s]], eps)
        assert torch.allclose(out[lo:hi], want, atol=2e-5, rtol=1e-4), f"draft prefill of sequence {s}"
    # then the last position of each as one decode step over the draft layer's cached latents
    batch = draft_batch(cache, [(next_ids[s][pre[s]:].tolist(), [pre[s]], tables[s], pre[s]) for s in (0, 1)])
    assert batch.is_decode_only
    out = model.draft_forward(batch, torch.stack([hidden[s][-1] for s in (0, 1)]))
    for s in (0, 1):
        want = oracle(hf, extra, next_ids[s], hidden[s], eps)[-1]
        assert torch.allclose(out[s], want, atol=2e-5, rtol=1e-4), f"draft decode of sequence {s}"
    # the logits of a draft come from the main LM head (the checkpoint's shared_head.head is its copy)
    assert torch.equal(model.compute_logits(out), out @ model.lm_head.weight.T)


def test_without_mtp_config_the_layer_is_skipped(mtp_checkpoint, tmp_path):
    directory, _, _ = mtp_checkpoint
    config = json.loads((directory / "config.json").read_text())
    config["num_nextn_predict_layers"] = 0
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(directory / "model.safetensors")
    harness = Harness(tmp_path)
    assert harness.model.mtp is None
    assert harness.model.draft_cache_layout(harness.engine.hf_config) == []
    with pytest.raises(NotImplementedError):
        harness.model.draft_forward(None, torch.zeros(1, 64))
