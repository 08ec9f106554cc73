"""Triton Gated DeltaNet kernels against the naive references: the chunked (WY) prefill over packed
varlen sequences and the fused decode step (conv, gating, L2 norm, delta rule, gated RMSNorm).

Runs on CPU under the Triton interpreter (tiny, odd head dims: the kernels mask any K, V); on a CUDA
machine the same tests run the compiled kernels.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from armillary.kernels.conv1d import causal_conv1d_varlen  # noqa: E402
from armillary.kernels.norm import gated_rms_norm  # noqa: E402
from armillary_qwen_gdn_moe.ops.gated_delta_rule import (  # noqa: E402
    chunk_gated_delta_rule_ref,
    recurrent_gated_delta_rule_ref,
)
from armillary_qwen_gdn_moe.ops.gated_delta_rule.chunk import (  # noqa: E402
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_slots,
)
from armillary.kernels.triton.device_buffers import ticket_buffer  # noqa: E402
from armillary_qwen_gdn_moe.ops.gated_delta_rule.fused_recurrent import fused_gdn_decode  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# fp32 inputs use "ieee" dots on the GPU (no tf32); fp16 keeps w, u and chunk states in fp16
TOL = {torch.float32: 1e-4, torch.float16: 1e-2}


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all()
    return ((out.float().cpu() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _offsets(lengths: list[int]) -> list[int]:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def _inputs(lengths, num_k_heads, num_v_heads, head_k, head_v, dtype, seed):
    """q, k: [T, H, K]; v: [T, HV, V]; g: [T, HV] fp32 log decays; beta: [T, HV]; states [B, HV, K, V]."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(total, num_k_heads, head_k, generator=gen).to(dtype)
    k = torch.randn(total, num_k_heads, head_k, generator=gen).to(dtype)
    v = torch.randn(total, num_v_heads, head_v, generator=gen).to(dtype)
    g = -torch.rand(total, num_v_heads, generator=gen).pow(3) * 2.0  # mostly mild decays, a few strong
    beta = torch.rand(total, num_v_heads, generator=gen).to(dtype)
    states = torch.randn(len(lengths), num_v_heads, head_k, head_v, generator=gen) * 0.5
    return q, k, v, g, beta, states


@pytest.mark.parametrize("lengths,H,HV,K,V,dtype,config", [
    ([1, 5, 63, 70], 1, 2, 24, 20, torch.float32, None),
    ([1, 5, 63, 70], 1, 2, 24, 20, torch.float16, None),
    ([130], 2, 2, 32, 48, torch.float32, {"state_bv": 16, "out_bv": 16, "intra_bv": 16, "intra_bk": 16}),
])
def test_chunk_matches_reference(lengths, H, HV, K, V, dtype, config):
    q, k, v, g, beta, states = _inputs(lengths, H, HV, K, V, dtype, seed=0)
    cu = _offsets(lengths)
    ref_o, ref_s = chunk_gated_delta_rule_ref(q, k, v, g, beta, cu, initial_state=states)
    dev = [t.to(DEVICE) for t in (q, k, v, g, beta, states)]
    o, final = chunk_gated_delta_rule(*dev[:5], torch.tensor(cu, dtype=torch.int32, device=DEVICE),
                                      initial_state=dev[5], config=config)
    assert o.shape == ref_o.shape and o.dtype == dtype and final.dtype == torch.float32
    assert _rel_err(o, ref_o) < TOL[dtype]
    assert _rel_err(final, ref_s) < TOL[dtype]
    # starting from zeros differs: the initial states are really read
    o_zero, _ = chunk_gated_delta_rule(*dev[:5], cu, config=config)
    assert _rel_err(o_zero, ref_o) > 1e-2


def test_chunk_slots_update_in_place_and_continue_split_sequences():
    """Strided views of one packed projection, states in shuffled slots, sequences cut in two calls
    (off chunk boundaries, one of them empty): equal to one reference pass over whole sequences."""
    H, HV, K, V = 1, 2, 16, 24
    lengths, split = [70, 9, 3], [66, 0, 3]
    gen = torch.Generator().manual_seed(4)
    total = sum(lengths)
    packed = torch.randn(total, 2 * H * K + HV * V + 5, generator=gen)
    q = packed[:, : H * K].reshape(total, H, K)
    k = packed[:, H * K : 2 * H * K].reshape(total, H, K)
    v = packed[:, 2 * H * K : 2 * H * K + HV * V].reshape(total, HV, V)
    g = -torch.rand(total, HV, generator=gen)
    beta = torch.rand(total, HV, generator=gen)
    pool = torch.randn(6, HV, K, V, generator=gen) * 0.5
    slots = torch.tensor([4, 1, 2])
    cu = _offsets(lengths)
    ref_o, ref_s = chunk_gated_delta_rule_ref(q, k, v, g, beta, cu, initial_state=pool[slots])

    got_pool = pool.to(DEVICE)
    got_o = torch.empty_like(ref_o)
    for part in (0, 1):
        pieces = [range(cu[b], cu[b] + split[b]) if part == 0 else range(cu[b] + split[b], cu[b + 1])
                  for b in range(len(lengths))]
        tokens = torch.tensor([t for p in pieces for t in p], dtype=torch.long)
        part_cu = _offsets([len(p) for p in pieces])
        o = chunk_gated_delta_rule_slots(
            q[tokens].to(DEVICE), k[tokens].to(DEVICE), packed.to(DEVICE)[tokens][:, 2 * H * K : 2 * H * K + HV * V]
            .reshape(-1, HV, V), g[tokens].to(DEVICE), beta[tokens].to(DEVICE),
            torch.tensor(part_cu, dtype=torch.int32, device=DEVICE), got_pool, slots.to(DEVICE), cu_seqlens_cpu=part_cu,
        )
        got_o[tokens] = o.cpu()
    assert _rel_err(got_o, ref_o) < 1e-4
    assert _rel_err(got_pool[slots], ref_s) < 1e-4
    untouched = [i for i in range(6) if i not in slots.tolist()]
    assert torch.equal(got_pool[untouched].cpu(), pool[untouched])


def test_chunk_without_l2norm_on_prenormalised_keys():
    lengths = [33, 64]
    q, k, v, g, beta, states = _inputs(lengths, 1, 1, 16, 16, torch.float32, seed=7)
    k = F.normalize(k, dim=-1) * 0.9
    cu = _offsets(lengths)
    ref_o, ref_s = chunk_gated_delta_rule_ref(q, k, v, g, beta, cu, initial_state=states, use_qk_l2norm=False)
    o, final = chunk_gated_delta_rule(*(t.to(DEVICE) for t in (q, k, v, g, beta)), cu,
                                      initial_state=states.to(DEVICE), scale=0.3, use_qk_l2norm=False)
    ref_o = ref_o * (0.3 / 16**-0.5)  # the reference scaled q by K^-0.5; outputs are linear in q
    assert _rel_err(o, ref_o) < 1e-4 and _rel_err(final, ref_s) < 1e-4


def _decode_reference(mixed, conv_weight, conv_states, ssm_states, A_log, dt_bias, norm_weight, slots, H, K, V):
    """The GatedDeltaNet layer math for one token per sequence (updates the state copies given)."""
    batch, HV = mixed.shape[0], A_log.shape[0]
    key_dim, value_dim = H * K, HV * V
    qkv, z, b, a = mixed.split([2 * key_dim + value_dim, value_dim, HV, HV], dim=-1)
    qkv = causal_conv1d_varlen(qkv, conv_weight, None, conv_states, slots, list(range(batch + 1)))
    q, k, v = qkv.split([key_dim, key_dim, value_dim], dim=-1)
    g = -A_log.exp() * F.softplus(a.float() + dt_bias)
    o, final = recurrent_gated_delta_rule_ref(
        q.reshape(batch, H, K), k.reshape(batch, H, K), v.reshape(batch, HV, V), g, b.sigmoid(),
        list(range(batch + 1)), initial_state=ssm_states[slots],
    )
    ssm_states[slots] = final
    return gated_rms_norm(o, z.reshape(batch, HV, V), norm_weight, 1e-6).reshape(batch, value_dim)


def _decode_case(H, HV, K, V, dtype, num_slots, gen):
    """Parameters and initial states of one layer: (params dict, conv_states, ssm_states)."""
    kernel, conv_dim = 4, 2 * H * K + HV * V
    params = {
        "conv_weight": (torch.randn(conv_dim, kernel, generator=gen) * 0.5).to(dtype),
        "A_log": torch.randn(HV, generator=gen) * 0.5,
        "dt_bias": torch.randn(HV, generator=gen) * 0.5,
        "norm_weight": torch.randn(V, generator=gen).to(dtype),
    }
    conv_states = torch.randn(num_slots, conv_dim, kernel - 1, generator=gen).to(dtype)
    return params, conv_states, torch.randn(num_slots, HV, K, V, generator=gen) * 0.3


# split_bv 0: a program per key head; 8: V in blocks of 8 (tickets for the windows and the row norm);
# 32 >= V: a program per whole value head (tickets for the q/k windows only when HV > H); None: the table's;
# preload: the state tile read before the PDL wait
@pytest.mark.parametrize("H,HV,K,V,dtype,config", [
    (2, 4, 24, 20, torch.float32, {"split_bv": 0}),
    (2, 4, 24, 20, torch.float16, None),
    (1, 3, 16, 36, torch.float32, {"split_bv": 0}),
    (2, 4, 24, 20, torch.float32, {"split_bv": 8, "num_warps": 2}),
    (2, 4, 24, 20, torch.float16, {"split_bv": 8}),
    (2, 4, 24, 20, torch.float32, {"split_bv": 32}),
    (1, 3, 16, 36, torch.float32, {"split_bv": 16, "num_warps": 1}),
    (3, 3, 16, 20, torch.float32, {"split_bv": 8}),
    (3, 3, 16, 20, torch.float32, {"split_bv": 32}),
    (2, 4, 24, 20, torch.float32, {"split_bv": 8, "preload": True}),
    (1, 3, 16, 36, torch.float16, {"split_bv": 16, "num_warps": 1, "preload": True}),
])
@pytest.mark.parametrize("batch", [1, 5])
def test_fused_decode_matches_layer_math(H, HV, K, V, dtype, config, batch):
    """Three steps in a row (the conv windows and the ticket counters carry over between calls)."""
    gen = torch.Generator().manual_seed(3 + batch)
    num_slots = batch + 3
    params, conv_states, ssm_states = _decode_case(H, HV, K, V, dtype, num_slots, gen)
    slots = torch.randperm(num_slots, generator=gen)[:batch]
    ref_conv, ref_ssm = conv_states.clone(), ssm_states.clone()
    got_conv, got_ssm = conv_states.to(DEVICE, copy=True), ssm_states.to(DEVICE, copy=True)
    dev = {name: t.to(DEVICE) for name, t in params.items()}
    for _ in range(3):
        mixed = torch.randn(batch, 2 * H * K + 2 * HV * V + 2 * HV, generator=gen).to(dtype)
        ref = _decode_reference(mixed, params["conv_weight"], ref_conv, ref_ssm, params["A_log"], params["dt_bias"],
                                params["norm_weight"], slots, H, K, V)
        out = fused_gdn_decode(
            mixed.to(DEVICE), dev["conv_weight"], got_conv, got_ssm, dev["A_log"], dev["dt_bias"],
            dev["norm_weight"], 1e-6, slots.to(DEVICE), H, K, V, config=config,
        )
        assert out.shape == (batch, HV * V) and out.dtype == dtype
        assert _rel_err(out, ref) < TOL[dtype]
        assert torch.equal(got_conv.cpu(), ref_conv)  # windows are copies of inputs
        assert _rel_err(got_ssm, ref_ssm) < TOL[dtype]
    untouched = [i for i in range(num_slots) if i not in slots.tolist()]
    assert torch.equal(got_ssm.cpu()[untouched], ssm_states[untouched])
    tickets = ticket_buffer(torch.device(DEVICE), 0)
    assert not tickets.any()  # every launch leaves its counters at zero


def test_fused_decode_value_split_is_deterministic_and_matches_key_head_walk():
    """Same inputs, two launches of the split: bitwise equal outputs; equal to the key-head walk
    up to summation order (the states) and bitwise on the conv windows."""
    H, HV, K, V, batch = 2, 4, 24, 20, 4
    gen = torch.Generator().manual_seed(11)
    params, conv_states, ssm_states = _decode_case(H, HV, K, V, torch.float32, batch, gen)
    mixed = torch.randn(batch, 2 * H * K + 2 * HV * V + 2 * HV, generator=gen).to(DEVICE)
    dev = {name: t.to(DEVICE) for name, t in params.items()}
    slots = torch.tensor([2, 0, 3, 1], device=DEVICE)

    def run(config):
        conv, ssm = conv_states.to(DEVICE, copy=True), ssm_states.to(DEVICE, copy=True)
        out = fused_gdn_decode(mixed, dev["conv_weight"], conv, ssm, dev["A_log"], dev["dt_bias"],
                               dev["norm_weight"], 1e-6, slots, H, K, V, config=config)
        return out, conv, ssm

    walk, split, again = run({"split_bv": 0}), run({"split_bv": 8}), run({"split_bv": 8})
    assert all(torch.equal(a, b) for a, b in zip(split, again))
    assert torch.equal(split[1], walk[1])
    assert _rel_err(split[0], walk[0].cpu()) < 1e-5 and _rel_err(split[2], walk[2].cpu()) < 1e-5


def test_decode_config_picks_the_smallest_batch_limit(monkeypatch):
    import armillary_qwen_gdn_moe.ops.gated_delta_rule.fused_recurrent as fr

    table = {"num_warps": 4, "split_bv": 0, "by_batch": {"1": {"split_bv": 32}, "16": {"split_bv": 64, "num_warps": 8}}}
    monkeypatch.setattr(fr, "kernel_config", lambda *args: dict(table))
    cpu = torch.device("cpu")
    assert fr.decode_config(1, 128, 128, cpu) == {"num_warps": 4, "split_bv": 32}
    assert fr.decode_config(2, 128, 128, cpu) == {"num_warps": 8, "split_bv": 64}
    assert fr.decode_config(16, 128, 128, cpu) == {"num_warps": 8, "split_bv": 64}
    assert fr.decode_config(17, 128, 128, cpu) == {"num_warps": 4, "split_bv": 0}
    assert fr.decode_config(17, 128, 128, cpu, {"num_warps": 2}) == {"num_warps": 2, "split_bv": 0}


@pytest.mark.parametrize("config", [{"split_bv": 0}, {"split_bv": 8}, {"split_bv": 32}])
def test_fused_decode_out_slots_chain_keeps_every_state(config):
    """Verifying drafts: step i reads the rows step i - 1 wrote (``out_slots``), so each position's
    state lands in its own row and the source rows stay as they were; the chain equals in-place steps."""
    H, HV, K, V, batch, steps = 2, 4, 24, 20, 3, 3
    gen = torch.Generator().manual_seed(21)
    num_rows = batch * (steps + 1)
    params, conv_states, ssm_states = _decode_case(H, HV, K, V, torch.float32, num_rows, gen)
    dev = {name: t.to(DEVICE) for name, t in params.items()}
    mixed = [torch.randn(batch, 2 * H * K + 2 * HV * V + 2 * HV, generator=gen) for _ in range(steps)]
    slots = torch.arange(batch)
    ref_conv, ref_ssm = conv_states.clone(), ssm_states.clone()
    got_conv, got_ssm = conv_states.to(DEVICE, copy=True), ssm_states.to(DEVICE, copy=True)
    rows = [slots] + [batch * (i + 1) + torch.arange(batch) for i in range(steps)]  # row chain per step
    for i in range(steps):
        ref = _decode_reference(mixed[i], params["conv_weight"], ref_conv, ref_ssm, params["A_log"],
                                params["dt_bias"], params["norm_weight"], slots, H, K, V)
        out = fused_gdn_decode(mixed[i].to(DEVICE), dev["conv_weight"], got_conv, got_ssm, dev["A_log"],
                               dev["dt_bias"], dev["norm_weight"], 1e-6, rows[i].to(DEVICE), H, K, V, config=config,
                               out_slots=rows[i + 1].to(DEVICE))
        assert _rel_err(out, ref) < TOL[torch.float32]
        assert torch.equal(got_conv.cpu()[rows[i + 1]], ref_conv[slots])
        assert _rel_err(got_ssm[rows[i + 1]], ref_ssm[slots]) < TOL[torch.float32]
    assert torch.equal(got_conv.cpu()[slots], conv_states[slots])  # the sources were only read
    assert torch.equal(got_ssm.cpu()[slots], ssm_states[slots])
    assert not ticket_buffer(torch.device(DEVICE), 0).any()


def _decode_ptx_sm90(split: bool, prefetch: bool, preload: bool) -> str:
    """``_gdn_decode_kernel`` compiled offline for sm_90 with PDL, at Qwen3.6's 16 key / 32 value heads of 128."""
    from armillary.testing.offline_ptx import kernel_ptx

    ptrs = ("mixed", "conv_weight", "conv_states", "ssm_states", "a_log", "dt_bias", "norm_weight", "state_slots",
            "out_slots", "out", "tickets", "rows", "partials")
    types = dict.fromkeys(ptrs, "*fp32") | {"mixed": "*bf16", "conv_weight": "*bf16", "conv_states": "*bf16",
                                             "norm_weight": "*bf16", "out": "*bf16", "state_slots": "*i32",
                                             "out_slots": "*i32", "tickets": "*i32"}
    ints = dict.fromkeys(("stride_mixed", "stride_w", "stride_conv", "stride_ssm", "stride_out"), "i32")
    consts = {"NUM_K_HEADS": 16, "GROUP": 2, "K": 128, "V": 128, "KW": 4, "KW_P2": 4, "BK": 128,
              "BV": 16 if split else 128, "SPLIT": split, "NV": 8 if split else 1, "NV_P2": 8 if split else 1,
              "BV_ROW": 128, "PDL": True, "PREFETCH": prefetch, "PRELOAD": preload}
    signature = {**types, **ints, "eps": "fp32", "scale": "fp32", **dict.fromkeys(consts, "constexpr")}
    return kernel_ptx("armillary_qwen_gdn_moe.ops.gated_delta_rule.fused_recurrent", "_gdn_decode_kernel", signature,
                      consts)


@pytest.mark.parametrize("split", [False, True])
def test_fused_decode_prefetches_its_state_before_the_pdl_wait_on_sm90(split):
    """With PREFETCH the state tile's L2 prefetches, and the slot-row loads (copied in before the step's first
    kernel), come before the wait."""
    from armillary.testing.offline_ptx import assert_prefetch_before_wait

    assert_prefetch_before_wait(_decode_ptx_sm90(split, prefetch=True, preload=False), prefetch=True,
                                loads_before_wait=2)


def test_fused_decode_preload_reads_the_state_tile_before_the_pdl_wait_on_sm90():
    """With PRELOAD (value split) the two slot rows and the whole [K, BV] state tile (128 x 16 fp32 over one warp:
    16 four-wide loads a thread) are loaded before the wait; without it only the slot rows."""
    from armillary.testing.offline_ptx import PDL_MARKS, instruction_sequence

    for preload, before in ((True, 2 + 16), (False, 2)):
        marks = instruction_sequence(_decode_ptx_sm90(True, prefetch=False, preload=preload), PDL_MARKS)
        wait = marks.index("griddepcontrol.wait")
        assert marks[0] == "griddepcontrol.launch_dependents", marks[:4]
        assert marks[:wait].count("ld.global") == before, marks[:wait + 1]
        assert "ld.global" in marks[wait:]
