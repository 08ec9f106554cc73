"""Shared layers: weight loaders (TP slices, stacked slots, MoE layouts, EP map), the unquantized methods, and a
third-party quantization registered through ``armillary_register_quantizations``."""
from __future__ import annotations

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import pytest

from armillary.cli import cmd_plugins
from armillary.errors import PluginError, WeightLoadError
from armillary.hf_config import HFConfig
from armillary.kernels.activation import get_activation
from armillary.layers import (
    CheckpointLoader,
    ColumnParallelLinear,
    FusedMoE,
    GatedMLP,
    GatedRMSNorm,
    LMHead,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RMSNorm,
    RowParallelLinear,
    VocabEmbedding,
    process_weights_after_loading,
)
from armillary.layers.quantization import (
    QuantConfig,
    UnquantizedConfig,
    UnquantizedFusedMoEMethod,
    UnquantizedLinearMethod,
    get_quant_config,
    resolve_quant_config,
    use_quant_config,
)
from armillary.kernels import norm as norm_ref
from armillary.parallel import ParallelContext, use_parallel
from armillary.registry import PluginRegistry, default_registry
from tests.fixtures import int8_weight_only

RANK1_OF_2 = ParallelContext(tp_rank=1, tp_size=2)


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def load(param: nn.Parameter, tensor: torch.Tensor, **kw):
    return param.weight_loader(param, tensor, **kw)


# ---------------------------------------------------------------- linear layers


def test_replicated_linear_loads_whole_and_equals_f_linear():
    layer = ReplicatedLinear(5, 3, bias=True, prefix="model.head")
    w, b, x = randn(3, 5), randn(3, seed=1), randn(4, 5, seed=2)
    assert load(layer.weight, w) == (slice(0, 3),) and load(layer.bias, b) == (slice(0, 3),)
    assert isinstance(layer.quant_method, UnquantizedLinearMethod)
    assert torch.equal(layer(x), F.linear(x, w, b))
    with pytest.raises(WeightLoadError, match=r"model\.head\.weight.*\(3, 5\).*\(3, 4\)"):
        load(layer.weight, randn(3, 4))
    with pytest.raises(WeightLoadError, match="takes no shard"):
        load(layer.weight, w, shard_id=0)


def test_column_parallel_rank_keeps_its_rows_and_ranks_concatenate():
    w, b, x = randn(6, 4), randn(6, seed=1), randn(2, 4, seed=2)
    outs = []
    for rank in (0, 1):
        with use_parallel(ParallelContext(tp_rank=rank, tp_size=2)):
            layer = ColumnParallelLinear(4, 6, bias=True)
        load(layer.weight, w), load(layer.bias, b)
        assert torch.equal(layer.weight, w[3 * rank:3 * rank + 3]) and torch.equal(layer.bias, b[3 * rank:3 * rank + 3])
        outs.append(layer(x))
    torch.testing.assert_close(torch.cat(outs, dim=-1), F.linear(x, w, b))
    with use_parallel(RANK1_OF_2), pytest.raises(ValueError, match="does not split"):
        ColumnParallelLinear(4, 5)


def test_row_parallel_rank_keeps_its_columns_bias_once_partials_sum():
    w, b, x = randn(3, 8), randn(3, seed=1), randn(2, 8, seed=2)
    partial = []
    for rank in (0, 1):
        with use_parallel(ParallelContext(tp_rank=rank, tp_size=2)):
            layer = RowParallelLinear(8, 3, bias=True, reduce_results=False)
        assert load(layer.weight, w) == (slice(0, 3),)
        load(layer.bias, b)
        assert torch.equal(layer.weight, w[:, 4 * rank:4 * rank + 4]) and torch.equal(layer.bias, b)
        partial.append(layer(x[:, 4 * rank:4 * rank + 4]))
    torch.testing.assert_close(partial[0] + partial[1], F.linear(x, w, b))  # the bias is added by rank 0 only


def test_row_parallel_without_a_process_group_fails_loudly():
    with use_parallel(RANK1_OF_2):
        layer = RowParallelLinear(4, 2)
    load(layer.weight, randn(2, 4))
    with pytest.raises(RuntimeError, match="torch.distributed"):
        layer(randn(1, 2))


def test_merged_column_slots_by_index_and_stacked_rank_slice():
    gate, up = randn(4, 3), randn(4, 3, seed=1)
    with use_parallel(RANK1_OF_2):
        layer = MergedColumnParallelLinear(3, [4, 4], bias=False)
    loader = CheckpointLoader(layer)
    assert load(layer.weight, gate, shard_id=0) == (slice(0, 2),)
    loader.rows.mark("weight", layer.weight, (slice(0, 2),))
    assert loader.loaded() == set()  # half the rows written
    assert load(layer.weight, up, shard_id=1) == (slice(2, 4),)
    loader.rows.mark("weight", layer.weight, (slice(2, 4),))
    assert loader.loaded() == {"weight"}
    assert torch.equal(layer.weight, torch.cat([gate[2:], up[2:]]))
    with use_parallel(RANK1_OF_2):
        stacked = MergedColumnParallelLinear(3, [4, 4])
    assert load(stacked.weight, torch.cat([gate, up])) == ()  # an already-stacked checkpoint tensor
    assert torch.equal(stacked.weight, layer.weight)
    with pytest.raises(WeightLoadError, match="shard_id must be an index below 2"):
        load(layer.weight, gate, shard_id=2)
    with pytest.raises(WeightLoadError, match=r"expects a checkpoint tensor of shape \(4, 3\)"):
        load(layer.weight, randn(2, 3), shard_id=0)


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_qkv_rank_slices_heads_and_replicates_too_few_kv_heads(kv_heads):
    head, heads, hidden = 2, 4, 3
    q_size = 2 * heads * head  # Qwen's gated query: per head [query | gate]
    q, k, v = randn(q_size, hidden), randn(kv_heads * head, hidden, seed=1), randn(kv_heads * head, hidden, seed=2)
    bq = randn(q_size, seed=3)
    with use_parallel(RANK1_OF_2):
        layer = QKVParallelLinear(hidden, head, heads, kv_heads, bias=True, q_size=q_size)
    assert (layer.num_heads, layer.num_kv_heads, layer.q_size, layer.kv_size) == (2, 1, 8, 2)
    for shard, t in (("q", q), ("k", k), ("v", v)):
        load(layer.weight, t, shard_id=shard)
    kv_rows = slice(2, 4) if kv_heads == 2 else slice(0, 2)  # rank 1's head, or the one head both ranks hold
    assert torch.equal(layer.weight, torch.cat([q[8:], k[kv_rows], v[kv_rows]]))
    assert load(layer.bias, bq, shard_id="q") == (slice(0, 8),)
    assert torch.equal(layer.bias[:8], bq[8:])
    with pytest.raises(WeightLoadError, match="'q', 'k' or 'v'"):
        load(layer.weight, q, shard_id="z")


def test_qkv_at_size_one_equals_the_stacked_f_linear():
    q, k, v, x = randn(8, 6), randn(4, 6, seed=1), randn(4, 6, seed=2), randn(3, 6, seed=3)
    layer = QKVParallelLinear(6, 2, 4, 2)
    for shard, t in (("q", q), ("k", k), ("v", v)):
        load(layer.weight, t, shard_id=shard)
    assert torch.equal(layer(x), F.linear(x, torch.cat([q, k, v])))


def test_gated_mlp_merged_and_split_agree_and_map_checkpoint_names():
    gate, up, down, x = randn(6, 4), randn(6, 4, seed=1), randn(4, 6, seed=2), randn(3, 4, seed=3)
    tensors = {"mlp.gate_proj.weight": gate, "mlp.up_proj.weight": up, "mlp.down_proj.weight": down}
    outs = []
    for merged in (True, False):
        model = nn.Module()
        model.mlp = GatedMLP(4, 6, "silu", merged=merged, prefix="mlp")
        loader = CheckpointLoader(model)
        for name, t in tensors.items():
            assert loader.load(name, t) is not None
        assert loader.loaded() == {n for n, _ in model.named_parameters()}
        outs.append(model.mlp(x))
    want = F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)
    torch.testing.assert_close(outs[0], want)
    torch.testing.assert_close(outs[1], want)


# ---------------------------------------------------------------- MoE


def _experts(num: int, inter: int, hidden: int, seed: int = 0):
    return [(randn(inter, hidden, seed=seed + 3 * e), randn(inter, hidden, seed=seed + 3 * e + 1),
             randn(hidden, inter, seed=seed + 3 * e + 2)) for e in range(num)]


def _moe_by_hand(x, experts, topk_weights, topk_ids, act="silu"):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(topk_weights[t].tolist(), topk_ids[t].tolist()):
            gate, up, down = experts[e]
            out[t] += w * F.linear(get_activation(act)(F.linear(x[t], gate)) * F.linear(x[t], up), down)
    return out


def test_moe_per_expert_and_fused_layouts_load_identically_with_a_shared_expert():
    experts = _experts(4, 3, 5)
    shared = _experts(1, 3, 5, seed=100)[0]
    model = nn.Module()
    model.experts = FusedMoE(4, 2, 5, 3, num_shared=1, prefix="experts")
    loader = CheckpointLoader(model)
    for e, (gate, up, down) in enumerate(experts):
        for proj, t in (("gate", gate), ("up", up), ("down", down)):
            assert loader.load(f"experts.{e}.{proj}_proj.weight", t) is not None
    assert loader.load("experts.4.gate_proj.weight", shared[0]) is None  # expert 4 is not a checkpoint expert
    assert loader.loaded() == set()  # the shared slot is still empty
    sid = model.experts.shared_expert_id()
    for proj, t in zip(("gate", "up", "down"), shared):
        param = model.experts.down_proj if proj == "down" else model.experts.gate_up_proj
        loader.rows.mark("experts.down_proj" if proj == "down" else "experts.gate_up_proj", param,
                         load(param, t, shard_id=proj, expert_id=sid))
    assert loader.loaded() == {"experts.gate_up_proj", "experts.down_proj"}

    fused = FusedMoE(4, 2, 5, 3, num_shared=1)
    stacked_w13 = torch.stack([torch.cat([g, u]) for g, u, _ in experts])  # transformers' [E, 2I, H]
    assert load(fused.gate_up_proj, stacked_w13) == (slice(0, 4),)
    assert load(fused.down_proj, torch.stack([d for _, _, d in experts])) == (slice(0, 4),)
    load(fused.gate_up_proj, torch.cat([shared[0], shared[1]]), expert_id=sid)
    load(fused.down_proj, shared[2], expert_id=sid)
    assert torch.equal(fused.gate_up_proj, model.experts.gate_up_proj)
    assert torch.equal(fused.down_proj, model.experts.down_proj)
    with pytest.raises(WeightLoadError, match="needs 4 \\(or 5\\) experts"):
        load(fused.down_proj, torch.zeros(3, 5, 3))
    with pytest.raises(WeightLoadError, match="shard_id must be one of"):
        load(fused.down_proj, shared[2], shard_id="gate", expert_id=0)


def test_moe_tensor_parallel_rank_keeps_its_intermediate_slice():
    experts = _experts(2, 4, 3)
    with use_parallel(RANK1_OF_2):
        layer = FusedMoE(2, 1, 3, 4)
    assert layer.gate_up_proj.shape == (2, 4, 3) and layer.down_proj.shape == (2, 3, 2)
    for e, (gate, up, down) in enumerate(experts):
        assert load(layer.gate_up_proj, gate, shard_id="gate", expert_id=e) == (e, slice(0, 2))
        assert load(layer.gate_up_proj, up, shard_id="up", expert_id=e) == (e, slice(2, 4))
        assert load(layer.down_proj, down, shard_id="down", expert_id=e) == (e,)
        assert torch.equal(layer.gate_up_proj[e], torch.cat([gate[2:], up[2:]]))
        assert torch.equal(layer.down_proj[e], down[:, 2:])


def test_moe_expert_parallel_map_and_partial_outputs_sum_to_the_whole():
    experts, x = _experts(4, 3, 5), randn(6, 5, seed=50)
    topk_ids = torch.tensor([[0, 3], [1, 2], [2, 3], [0, 1], [3, 3], [1, 0]])
    topk_weights = torch.rand(6, 2, generator=torch.Generator().manual_seed(1))
    partial = []
    for rank in (0, 1):
        with use_parallel(ParallelContext(ep_rank=rank, ep_size=2)):
            layer = FusedMoE(4, 2, 5, 3, reduce_results=False)
        assert layer.local_experts == [2 * rank, 2 * rank + 1]
        assert layer.expert_map.tolist() == ([0, 1, -1, -1] if rank == 0 else [-1, -1, 0, 1])
        for e, (gate, up, down) in enumerate(experts):
            written = load(layer.gate_up_proj, torch.cat([gate, up]), expert_id=e)
            assert written == ((e - 2 * rank,) if e // 2 == rank else None)  # another rank's expert: skipped
            load(layer.down_proj, down, shard_id="down", expert_id=e)
        partial.append(layer(x, topk_weights, topk_ids))
    torch.testing.assert_close(partial[0] + partial[1], _moe_by_hand(x, experts, topk_weights, topk_ids))


def test_plain_experts_take_up_and_down_only():
    """``gated=False`` (Nemotron's relu² experts): ``gate_up_proj`` holds the up rows alone."""
    ups, downs, x = [randn(4, 3, seed=e) for e in range(2)], [randn(3, 4, seed=9 + e) for e in range(2)], randn(2, 3)
    layer = FusedMoE(2, 1, 3, 4, "relu2", gated=False)
    assert layer.gate_up_proj.shape == (2, 4, 3)
    model = nn.Module()
    model.experts = layer
    loader = CheckpointLoader(model)
    for e in range(2):
        loader.load(f"experts.{e}.up_proj.weight", ups[e])
        loader.load(f"experts.{e}.down_proj.weight", downs[e])
    assert loader.loaded() == {"experts.gate_up_proj", "experts.down_proj"}
    with pytest.raises(WeightLoadError, match="shard_id must be one of"):
        load(layer.gate_up_proj, ups[0], shard_id="gate", expert_id=0)
    ids, weights = torch.tensor([[1], [0]]), torch.tensor([[0.5], [2.0]])
    want = torch.stack([w * F.linear(F.relu(F.linear(x[t], ups[e])) ** 2, downs[e])
                        for t, (w, e) in enumerate(zip(weights[:, 0].tolist(), ids[:, 0].tolist()))])
    torch.testing.assert_close(layer(x, weights, ids), want)


def test_unquantized_moe_method_equals_the_reference_by_hand():
    experts, x = _experts(3, 4, 6), randn(5, 6, seed=9)
    layer = FusedMoE(3, 2, 6, 4)
    assert isinstance(layer.quant_method, UnquantizedFusedMoEMethod)
    load(layer.gate_up_proj, torch.stack([torch.cat([g, u]) for g, u, _ in experts]))
    load(layer.down_proj, torch.stack([d for _, _, d in experts]))
    topk_ids = torch.tensor([[0, 2], [1, 0], [2, 1], [2, 0], [1, 2]])
    topk_weights = torch.rand(5, 2, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(layer(x, topk_weights, topk_ids), _moe_by_hand(x, experts, topk_weights, topk_ids))


# ---------------------------------------------------------------- norms, embedding, loader


def test_norms_and_vocabulary_layers():
    x, r, gate = randn(3, 8), randn(3, 8, seed=1), randn(3, 8, seed=2)
    norm = RMSNorm(8, 1e-6, zero_centered=True)
    gated = GatedRMSNorm(8, 1e-6, group_size=4)
    model = nn.Module()
    model.norm, model.gated = norm, gated
    model.embed, model.head = VocabEmbedding(10, 8), LMHead(8, 10)
    model.head.tie_to(model.embed)
    loader = CheckpointLoader(model)
    for name, t in (("norm.weight", randn(8, seed=3)), ("gated.weight", randn(8, seed=4)),
                    ("embed.weight", randn(10, 8, seed=5))):
        assert loader.load(name, t) is not None
    names = {"norm.weight", "gated.weight", "embed.weight"}  # the tied head is no parameter of its own
    assert loader.loaded() == {n for n, _ in model.named_parameters()} == names
    assert loader.load("mystery.weight", x) is None
    assert torch.equal(norm(x), norm_ref.rms_norm(x, norm.weight, 1e-6, True))
    normed, summed = norm.add(x, r)
    assert torch.equal(summed, x + r) and torch.equal(normed, norm_ref.rms_norm(x + r, norm.weight, 1e-6, True))
    assert torch.equal(gated(x, gate), norm_ref.gated_rms_norm(x, gate, gated.weight, 1e-6, 4, True))
    ids = torch.tensor([1, 7, 7])
    assert torch.equal(model.embed(ids), model.embed.weight[ids])
    assert torch.equal(model.head.compute_logits(x), F.linear(x, model.embed.weight).float())


def test_loader_wraps_shape_errors_with_the_checkpoint_name():
    model = nn.Module()
    model.proj = ReplicatedLinear(4, 2, prefix="proj")
    with pytest.raises(WeightLoadError, match=r"checkpoint tensor ckpt\.proj\.weight -> proj\.weight: proj\.weight"):
        CheckpointLoader(model).load("proj.weight", randn(3, 4), source="ckpt.proj.weight")


# ---------------------------------------------------------------- quantization registry and a third-party format


@pytest.fixture
def int8_registry() -> PluginRegistry:
    registry = PluginRegistry()
    registry.register(int8_weight_only, "int8_test_plugin")
    return registry


def test_quantization_registry_records_and_resolution(int8_registry):
    assert int8_registry.infos["core"].quantizations == ["compressed-tensors", "fp8", "modelopt", "unquantized"]
    assert int8_registry.infos["int8_test_plugin"].quantizations == [int8_weight_only.NAME]
    with pytest.raises(PluginError, match="duplicate quantization"):
        int8_registry.quantizations.register("unquantized", "x:Y")
    assert isinstance(resolve_quant_config(HFConfig({"architectures": ["X"]}), int8_registry), UnquantizedConfig)
    nested = HFConfig({"text_config": {"quantization_config": {"quant_method": int8_weight_only.NAME}}})
    assert isinstance(resolve_quant_config(nested, int8_registry.quantizations), int8_weight_only.Int8WeightOnlyConfig)
    with pytest.raises(PluginError, match=r"'nvfp4'.*registered quantizations: compressed-tensors, fp8, "
                                          r"int8_weight_only_test, modelopt, unquantized"):
        resolve_quant_config({"quantization_config": {"quant_method": "nvfp4"}}, int8_registry)


def test_armillary_plugins_lists_quantizations_whose_references_resolve(capsys):
    cmd_plugins(None)
    assert "  quantization unquantized" in capsys.readouterr().out.splitlines()
    for spec in default_registry().quantizations:  # every installed plugin's lazy reference is a real QuantConfig
        cls = spec.load()
        assert issubclass(cls, QuantConfig) and cls.name == spec.name, spec


def test_a_plugin_format_builds_loads_and_runs_a_layer(int8_registry):
    hf = HFConfig({"quantization_config": {"quant_method": int8_weight_only.NAME, "ignore": ["model.head"]}})
    gate, up = torch.randint(-127, 128, (4, 6), dtype=torch.int8), torch.randint(-127, 128, (4, 6), dtype=torch.int8)
    gate_scale, up_scale = torch.rand(4) / 64, torch.rand(4) / 64
    head_w, x = randn(3, 6), randn(2, 6, seed=1)
    with use_quant_config(resolve_quant_config(hf, int8_registry)), use_parallel(RANK1_OF_2):
        model = nn.Module()
        model.proj = MergedColumnParallelLinear(6, [4, 4], prefix="model.proj")
        model.head = ReplicatedLinear(6, 3, prefix="model.head")
    assert isinstance(get_quant_config(), UnquantizedConfig)  # the context ended
    assert isinstance(model.proj.quant_method, int8_weight_only.Int8WeightOnlyMethod)
    assert isinstance(model.head.quant_method, UnquantizedLinearMethod)  # named by the ignore list
    assert model.proj.weight.dtype == torch.int8 and model.proj.weight_scale.shape == (4,)
    loader = CheckpointLoader(model)
    for name, t, shard in (("proj.weight", gate, 0), ("proj.weight", up, 1), ("proj.weight_scale", gate_scale, 0),
                           ("proj.weight_scale", up_scale, 1)):
        param = model.get_parameter(name)
        loader.rows.mark(name, param, load(param, t, shard_id=shard))
    loader.load("head.weight", head_w)
    assert loader.loaded() == {"proj.weight", "proj.weight_scale", "head.weight"}
    assert torch.equal(model.proj.weight_scale, torch.cat([gate_scale[2:], up_scale[2:]]))  # rank 1's rows
    process_weights_after_loading(model)
    process_weights_after_loading(model)  # once per layer, however often it is called
    assert model.proj.times_processed == 1
    want_w = torch.cat([gate[2:].float() * gate_scale[2:, None], up[2:].float() * up_scale[2:, None]])
    torch.testing.assert_close(model.proj(x), F.linear(x, want_w))
    assert torch.equal(model.head(x), F.linear(x, head_w))


# ---------------------------------------------------------------- a real 2-rank group


def test_column_then_row_parallel_over_two_gloo_ranks_equals_one(tmp_path):
    from tests.fixtures import tp_linear_worker

    mp.spawn(tp_linear_worker.run, args=(2, str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        torch.testing.assert_close(result["got"], result["want"])
