"""Nemotron-H over two and four ranks on the CPU (gloo, one process per rank) against transformers: tensor
parallelism (the Mamba heads with their groups, conv channels and states, the attention heads, the MLP and expert
widths split), expert parallelism (1 / ep of the experts, whole, per rank) and both over the same ranks; greedy
tokens identical and logits close over 32 steps, one prompt at a time and all at once; rank 0 holds its share. The
runs cover groups that split over the ranks and groups replicated on two ranks each (their gated norm summed over
them), a stacked and a separate shared expert, a dense relu² layer and a tied head. Without processes: which heads,
groups, in_proj rows and conv channels a rank keeps, replicated groups at four ranks, a per-tensor fp8 scale in every
in_proj slot, and the layouts refused. MTP speculation (K = 2) over two ranks equals one process without it."""
from __future__ import annotations

import pytest
import torch

from armillary import LLM
from armillary.hf_config import HFConfig
from armillary.layers.quantization import use_quant_config
from armillary.layers.quantization.modelopt import ModelOptConfig
from armillary.parallel import ParallelContext, use_parallel
from armillary.sampling_params import SamplingParams
from armillary.testing import assert_reference_run, cpu_engine, lazy_references
from armillary_nemotron.config import NemotronHArgs
from armillary_nemotron.mamba_mixer import Mamba2Mixer
from armillary_nemotron.mamba_shard import MambaInProj, MambaShard, mamba_shard
from armillary_nemotron.model import NemotronHForCausalLM
from plugins.nemotron.tests.hf_models import CASES_BY_NAME, NEW_TOKENS, make_reference, nemotron_registry, prompts
from plugins.nemotron.tests.mtp_checkpoint import save_with_mtp
from tests.fixtures.engine_runs import run_to_completion

# (case, tp, ep): 2 groups split, stacked shared expert (TP widths, then EP with it on rank 0); 4 groups, a separate
# shared expert and a dense layer (TP, and TP + EP: one sum of experts and shared expert); 1 group replicated, tied
RUNS = [("ME*ME_groups2_chunk8", 2, 1), ("ME*ME_groups2_chunk8", 1, 2), ("M*-EM_groups4_router_groups", 2, 1),
        ("M*-EM_groups4_router_groups", 2, 2), ("*MEM-_groups1_tied", 2, 1),
        # four ranks: 2 groups each replicated on two ranks (its norm summed over them), two kv heads replicated;
        # 4 groups split with the experts whole, two a rank
        ("ME*ME_groups2_chunk8", 4, 1), ("M*-EM_groups4_router_groups", 4, 4)]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return lazy_references(make_reference, tmp_path_factory)


def _assert_rank0_share(llm: LLM, cfg: dict, tp: int, ep: int) -> None:
    model = llm.engine.model
    layers = model.backbone.layers
    mixer = next(b.mixer for b in layers if b.kind == "mamba")
    heads, groups, n = cfg["mamba_num_heads"] // tp, max(1, cfg["n_groups"] // tp), cfg["ssm_state_size"]
    d_inner = heads * cfg["mamba_head_dim"]
    assert (mixer.heads, mixer.groups, mixer.d_inner) == (heads, groups, d_inner)
    assert mixer.conv1d.weight.shape[0] == mixer.conv_dim == d_inner + 2 * groups * n
    assert mixer.in_proj.weight.shape[0] == 2 * d_inner + 2 * groups * n + heads
    assert mixer.out_proj.weight.shape[1] == d_inner and mixer.norm.weight.shape == (d_inner,)
    assert mixer.A_log.shape == mixer.D.shape == mixer.dt_bias.shape == (heads,)
    attn = next(b.mixer for b in layers if b.kind == "attention")
    kv_heads = max(1, cfg["num_key_value_heads"] // tp)  # fewer kv heads than ranks: one replicated
    assert (attn.num_heads, attn.num_kv_heads) == (cfg["num_attention_heads"] // tp, kv_heads)
    moe = next(b.mixer for b in layers if b.kind == "moe")
    routed = [e for e in moe.experts.local_experts if e < cfg["n_routed_experts"]]
    assert len(routed) == cfg["n_routed_experts"] // ep
    assert moe.experts.intermediate_size_per_partition == cfg["moe_intermediate_size"] // (tp if ep == 1 else 1)
    assert model.backbone.embeddings.weight.shape[0] == -(-cfg["vocab_size"] // tp)
    caches = llm.engine.worker.caches
    conv, ssm = next(c for c in caches if hasattr(c, "tensors")).tensors
    assert conv.shape[1] == mixer.conv_dim and ssm.shape[1:] == (heads, cfg["mamba_head_dim"], n)  # rank 0's states
    kv = next(c for c in caches if hasattr(c, "k"))
    assert kv.k.shape[-2] == attn.num_kv_heads


@pytest.mark.parametrize("name,tp,ep", RUNS, ids=[f"{n}-tp{tp}-ep{ep}" for n, tp, ep in RUNS])
def test_ranks_match_transformers(references, name, tp, ep):
    reference = references(CASES_BY_NAME[name])
    llm = LLM(str(reference.model_dir), registry=nemotron_registry(), dtype="float32", device="cpu", max_model_len=256,
              tensor_parallel_size=tp, expert_parallel_size=ep, distributed_timeout_s=60, cpu_kv_cache_space_gb=0.05)
    try:
        _assert_rank0_share(llm, reference.case.config, tp, ep)
        assert_reference_run(llm, reference, NEW_TOKENS)
    finally:
        llm.engine.shutdown()


def _hf(heads: int, groups: int) -> HFConfig:
    """A Mamba layer and an attention layer: head dim 4, state 3."""
    return HFConfig(dict(CASES_BY_NAME["ME*ME_groups2_chunk8"].config, hybrid_override_pattern="M*",
                         mamba_num_heads=heads, mamba_head_dim=4, n_groups=groups, ssm_state_size=3))


def _at(rank: int, tp: int) -> ParallelContext:
    return ParallelContext(rank=rank, world_size=tp, tp_rank=rank, tp_size=tp)


@torch.no_grad()
@pytest.mark.parametrize("heads,groups,tp", [(8, 4, 2), (8, 2, 4)], ids=["groups-split", "groups-replicated"])
def test_a_rank_keeps_its_heads_groups_rows_and_channels(heads, groups, tp):
    """Checkpoint tensors whose every row holds its own index: each rank's in_proj rows, conv channels, per-head
    tensors and norm channels are its heads' and its group's (at four ranks over two groups, ranks 0, 1 share
    group 0 and 2, 3 group 1); the cache layout has the same shapes."""
    cfg = NemotronHArgs.parse(_hf(heads, groups))
    d, gn, p, n = cfg.d_inner, groups * 3, 4, 3
    full_in = 2 * d + 2 * gn + heads
    for rank in range(tp):
        with use_parallel(_at(rank, tp)):
            mixer = Mamba2Mixer(cfg, prefix="m")
            layout = NemotronHForCausalLM.cache_layout(_hf(heads, groups))
        h = heads // tp
        g_loc, g0 = max(1, groups // tp), rank * groups // tp
        mixer.in_proj.weight_loader(mixer.in_proj.weight, torch.arange(full_in).float()[:, None].expand(-1, 64))
        mixer.conv1d.weight.weight_loader(mixer.conv1d.weight, torch.arange(d + 2 * gn).float()[:, None, None]
                                          .expand(-1, 1, 4))
        mixer.A_log.weight_loader(mixer.A_log, torch.arange(heads).float())
        mixer.norm.weight.weight_loader(mixer.norm.weight, torch.arange(d).float())
        x_rows = list(range(rank * h * p, (rank + 1) * h * p))
        b_rows = list(range(g0 * n, (g0 + g_loc) * n))
        want_in = x_rows + [d + r for r in x_rows] + [2 * d + r for r in b_rows] + [2 * d + gn + r for r in b_rows] \
            + [2 * d + 2 * gn + rank * h + i for i in range(h)]
        assert mixer.in_proj.weight[:, 0].tolist() == want_in
        assert mixer.conv1d.weight[:, 0, 0].tolist() == x_rows + [d + r for r in b_rows] + [d + gn + r for r in b_rows]
        assert mixer.A_log.tolist() == list(range(rank * h, (rank + 1) * h))
        assert mixer.norm.weight.tolist() == x_rows
        assert mixer.shard.norm_across_ranks == (groups < tp)
        assert layout[0].shapes == ((d // tp + 2 * g_loc * n, cfg.conv_kernel - 1), (h, p, n))


@pytest.mark.parametrize("heads,groups,tp,match", [(6, 3, 2, "neither split"), (6, 6, 4, "does not split")])
def test_layouts_that_cannot_split_are_refused(heads, groups, tp, match):
    with use_parallel(_at(0, tp)), pytest.raises(ValueError, match=match):
        mamba_shard(NemotronHArgs.parse(_hf(heads, groups)))


@torch.no_grad()
def test_a_per_tensor_scaled_in_proj_keeps_its_one_scale_in_every_slot():
    """ModelOpt FP8 stores one weight_scale / input_scale for the whole in_proj; cut into five slots at two ranks,
    each slot keeps it, and the rows are rank 1's."""
    shard = MambaShard(tp_rank=1, tp_size=2, total_heads=4, total_groups=2, head_dim=4, state_size=3, heads=2,
                       groups=1)
    with use_parallel(_at(1, 2)), use_quant_config(ModelOptConfig("FP8")):
        in_proj = MambaInProj(16, shard, False, prefix="backbone.layers.0.mixer.in_proj")
    weight = (torch.arange(48.0)[:, None] / 8 - 3).expand(-1, 16).to(torch.float8_e4m3fn)  # z 16 | x 16 | B, C 6 | dt 4
    in_proj.weight.weight_loader(in_proj.weight, weight)
    in_proj.weight_scale.weight_loader(in_proj.weight_scale, torch.tensor(0.5))
    in_proj.input_scale.weight_loader(in_proj.input_scale, torch.tensor([0.25]))
    assert in_proj.weight_scale.tolist() == [0.5] * 5 and in_proj.input_scale.tolist() == [0.25] * 5
    rows = [*range(8, 16), *range(24, 32), *range(35, 38), *range(41, 44), 46, 47]
    assert torch.equal(in_proj.weight.float(), weight[rows].float())


def test_mtp_speculation_over_two_ranks_equals_no_speculation(tmp_path):
    """An attention + MoE MTP head over two ranks: drafts and verify in lockstep, the Mamba states the plan commits."""
    model_dir = save_with_mtp("ME*ME_groups2_chunk8", "*E", tmp_path).model_dir
    work = [(p, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)) for p in prompts()]
    args = dict(block_size=8, num_kv_blocks=128, max_num_seqs=8, max_model_len=256, distributed_timeout_s=60)
    base = run_to_completion(cpu_engine(model_dir, nemotron_registry(), **args), work)
    engine = cpu_engine(model_dir, nemotron_registry(), **args, tensor_parallel_size=2, speculative=True, num_drafts=2)
    try:
        assert run_to_completion(engine, work) == base
        assert engine.stats()["num_verify_steps"] > 0
        engine.cache.check_accounting([])
    finally:
        engine.shutdown()
