"""Nemotron-H's MTP draft head: the config's two spellings, the draft cache layout, every ``mtp.*``
tensor loaded, and ``draft_forward`` against a plain composition of transformers' own NemotronH blocks
(the MTP sublayers) with ``enorm`` / ``hnorm`` / ``eh_proj`` / ``final_layernorm`` by hand, over a
prefill pass and a decode pass that reads the draft attention layer's paged KV cache."""
from __future__ import annotations

import json

import pytest
import torch

from armillary.cache_spec import FullAttention
from armillary.errors import WeightLoadError
from armillary.forward_batch import ForwardBatch, KVCache
from armillary.hf_config import HFConfig
from armillary.testing import cpu_engine, paged_batch, read_checkpoint
from armillary_nemotron.config import ATTENTION, MAMBA, MLP, MOE, NemotronHArgs
from armillary_nemotron.model import NemotronHForCausalLM
from plugins.nemotron.tests.hf_models import CASES_BY_NAME, VOCAB, nemotron_registry
from plugins.nemotron.tests.mtp_checkpoint import save_with_mtp

BLOCK = 4


@pytest.fixture(scope="module")
def mtp(tmp_path_factory):
    return save_with_mtp("ME*ME_groups2_chunk8", "*E", tmp_path_factory.mktemp("nemotron_mtp"))


def _hf(**extra) -> HFConfig:
    return HFConfig(dict(CASES_BY_NAME["ME*ME_groups2_chunk8"].config, **extra))


def test_config_reads_both_spellings_and_refuses_mamba_sublayers():
    assert NemotronHArgs.parse(_hf()).mtp_kinds == ()
    # transformers 5 saves mtp_layers_block_type even without MTP layers: only num_nextn_predict_layers counts
    assert NemotronHArgs.parse(_hf(mtp_layers_block_type=["full_attention", "moe"])).mtp_kinds == ()
    nvidia = _hf(num_nextn_predict_layers=1, mtp_hybrid_override_pattern="*E")  # Nemotron-3 Super's config.json
    assert NemotronHArgs.parse(nvidia).mtp_kinds == (ATTENTION, MOE)
    listed = _hf(num_nextn_predict_layers=1, mtp_layers_block_type=["moe", "full_attention", "mlp"])
    assert NemotronHArgs.parse(listed).mtp_kinds == (MOE, ATTENTION, MLP)
    assert NemotronHArgs.parse(_hf(num_nextn_predict_layers=1)).mtp_kinds == (ATTENTION, MOE)  # transformers' default
    assert NemotronHForCausalLM.draft_cache_layout(nvidia) == [FullAttention(2, 16), None]
    assert NemotronHForCausalLM.draft_cache_layout(listed) == [None, FullAttention(2, 16), None]
    assert NemotronHForCausalLM.draft_cache_layout(_hf()) == []
    with pytest.raises(ValueError, match="unknown layer letters"):
        NemotronHArgs.parse(_hf(num_nextn_predict_layers=1, mtp_hybrid_override_pattern="*X"))
    mamba = _hf(num_nextn_predict_layers=1, mtp_hybrid_override_pattern="M*")
    assert NemotronHArgs.parse(mamba).mtp_kinds == (MAMBA, ATTENTION)
    with pytest.raises(NotImplementedError, match="Mamba"):
        NemotronHForCausalLM.draft_cache_layout(mamba)
    with pytest.raises(NotImplementedError, match="one MTP layer"):
        NemotronHForCausalLM.draft_cache_layout(_hf(num_nextn_predict_layers=2, mtp_hybrid_override_pattern="*E"))


def test_every_mtp_tensor_loads(mtp):
    engine = cpu_engine(mtp.model_dir, nemotron_registry())
    model = engine.model
    tensors = read_checkpoint(mtp.model_dir)
    loaded = model.load_weights(iter(tensors.items()))  # a second load: the names it fills
    params = {name for name, _ in model.named_parameters()}
    mtp_params = {name for name in params if name.startswith("mtp.")}
    assert mtp_params and loaded == params  # every parameter, the MTP head's included, completely written
    with pytest.raises(WeightLoadError, match="mtp.layers.1.mixer.bogus"):  # none the model does not know
        model.load_weights([("mtp.layers.1.mixer.bogus.weight", torch.zeros(2))])
    for name, tensor in mtp.extra.items():  # the MTP-only tensors land where the checkpoint names them
        assert torch.equal(model.get_parameter(name), tensor), name
    assert torch.equal(model.get_parameter("mtp.layers.0.mixer.o_proj.weight"),
                       tensors["mtp.layers.0.mixer.o_proj.weight"])


def test_without_mtp_config_the_tensors_are_skipped(mtp, tmp_path, caplog):
    config = json.loads((mtp.model_dir / "config.json").read_text())
    config["num_nextn_predict_layers"] = 0
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(mtp.model_dir / "model.safetensors")
    with caplog.at_level("INFO", logger="armillary_nemotron.model"):
        engine = cpu_engine(tmp_path, nemotron_registry())
    assert engine.model.mtp is None
    assert "skipped 30 mtp.* tensors" in caplog.text
    with pytest.raises(NotImplementedError, match="declares no MTP"):
        engine.model.draft_forward(None, torch.zeros(1, 64))


def _draft_batch(cache, rows: list[tuple[list[int], list[int], list[int], int]]) -> ForwardBatch:
    """rows: per sequence (new token ids, their positions, block table, cached tokens before them)."""
    return paged_batch([cache, None], rows, BLOCK)


@torch.no_grad()
def _oracle(mtp, next_ids: torch.Tensor, hidden: torch.Tensor, eps: float) -> torch.Tensor:
    """One sequence at positions 0..L-1: final_layernorm(moe_block(attn_block(eh_proj([enorm(e) ; hnorm(h)]))))."""

    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    e = mtp.extra
    x = torch.cat((norm(mtp.hf.model.embeddings(next_ids), e["mtp.layers.0.enorm.weight"]),
                   norm(hidden, e["mtp.layers.0.hnorm.weight"])), -1)
    x = (x @ e["mtp.layers.0.eh_proj.weight"].T)[None]  # [1, L, H]
    length = x.shape[1]
    mask = torch.full((length, length), float("-inf")).triu(1)[None, None]
    for layer in mtp.hf.model.layers[mtp.num_main:]:
        x = layer(x, attention_mask=mask, position_ids=torch.arange(length)[None])
    return norm(x[0], e["mtp.layers.1.final_layernorm.weight"])


@torch.no_grad()
def test_draft_forward_matches_transformers_blocks(mtp):
    model = cpu_engine(mtp.model_dir, nemotron_registry()).model
    eps = model.config.eps
    gen = torch.Generator().manual_seed(7)
    lengths = (11, 6)
    hidden = [torch.randn(n, 64, generator=gen) for n in lengths]  # stand-ins for the main model's hidden
    next_ids = [torch.randint(1, VOCAB, (n,), generator=gen) for n in lengths]
    cache = KVCache(torch.zeros(16, BLOCK, 2, 16), torch.zeros(16, BLOCK, 2, 16))
    tables = [[3, 7, 1, 9], [5, 2]]
    pre = [n - 1 for n in lengths]
    # prefill: positions 0..n-2 of both sequences in one pass
    batch = _draft_batch(cache, [(next_ids[s][:pre[s]].tolist(), list(range(pre[s])), tables[s], 0) for s in (0, 1)])
    out = model.draft_forward(batch, torch.cat([hidden[s][:pre[s]] for s in (0, 1)]))
    for s, (lo, hi) in enumerate(zip(batch.query_start_loc_cpu, batch.query_start_loc_cpu[1:])):
        want = _oracle(mtp, next_ids[s][:pre[s]], hidden[s][:pre[s]], eps)
        assert torch.allclose(out[lo:hi], want, atol=2e-5, rtol=1e-4), f"draft prefill of sequence {s}"
    # then each one's last position as a decode step over the draft attention layer's cached K/V
    batch = _draft_batch(cache, [(next_ids[s][pre[s]:].tolist(), [pre[s]], tables[s], pre[s]) for s in (0, 1)])
    assert batch.is_decode_only
    out = model.draft_forward(batch, torch.stack([hidden[s][-1] for s in (0, 1)]))
    for s in (0, 1):
        want = _oracle(mtp, next_ids[s], hidden[s], eps)[-1]
        assert torch.allclose(out[s], want, atol=2e-5, rtol=1e-4), f"draft decode of sequence {s}"
    # the drafts' logits come from the main LM head
    assert torch.equal(model.compute_logits(out), out @ model.lm_head.weight.T)
