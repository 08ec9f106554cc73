"""Mamba-2 kernels against their naive references (and those against transformers' torch SSD and a
token-by-token recurrence): the varlen chunked scan from and into slot states and the fused decode
step (conv update, selective state update, grouped gated norm), at odd sizes under the Triton
interpreter on the CPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from armillary_nemotron.ops.mamba import decode as tri_decode
from armillary_nemotron.ops.mamba import ssd_scan as tri_scan
from armillary_nemotron.ops.mamba.naive import (
    causal_conv1d_update_ref,
    discretize_dt,
    selective_state_update_ref,
    ssd_chunk_scan_one,
    ssd_chunk_scan_ref,
)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter evaluates masked lanes


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


def make_inputs(total: int, heads: int, head_dim: int, groups: int, state: int, slots: int, seed: int = 0,
                dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    conv_dim = heads * head_dim + 2 * groups * state
    xbc = torch.randn(total, conv_dim, generator=gen).to(dtype)  # the conv output rows
    dt = (torch.randn(total, heads, generator=gen) * 0.5 - 1.0).to(dtype)
    A = -torch.rand(heads, generator=gen) * 2 - 0.1
    D = torch.randn(heads, generator=gen)
    dt_bias = torch.randn(heads, generator=gen) * 0.5
    states = torch.randn(slots, heads, head_dim, state, generator=gen) * 0.3
    return xbc, dt, A, D, dt_bias, states


def split(xbc: torch.Tensor, heads: int, head_dim: int, groups: int, state: int):
    d = heads * head_dim
    return xbc[:, :d], xbc[:, d : d + groups * state], xbc[:, d + groups * state :]


def recurrent(x, dt, A, B, C, D, state):
    """Token-by-token recurrence (the definition) for one sequence: x [L, H, P] ... -> y, final state."""
    heads, groups = x.shape[1], B.shape[1]
    Bh = B.repeat_interleave(heads // groups, 1)
    Ch = C.repeat_interleave(heads // groups, 1)
    ys = []
    for t in range(x.shape[0]):
        state = torch.exp(dt[t] * A)[:, None, None] * state + (dt[t][:, None] * x[t])[..., None] * Bh[t][:, None, :]
        ys.append(torch.einsum("hpn,hn->hp", state, Ch[t]) + D[:, None] * x[t])
    return torch.stack(ys), state


@pytest.mark.parametrize("length,chunk", [(1, 4), (7, 4), (19, 8), (33, 16)])
def test_naive_chunked_equals_recurrence(length, chunk):
    heads, p, g, n = 4, 5, 2, 6
    xbc, dt, A, D, dt_bias, states = make_inputs(length, heads, p, g, n, 1, seed=length)
    x, B, C = split(xbc, heads, p, g, n)
    dtd = discretize_dt(dt, dt_bias, 1e-3)
    y, final = ssd_chunk_scan_one(x.reshape(length, heads, p), dtd, A, B.reshape(length, g, n),
                                  C.reshape(length, g, n), chunk, states[0])
    y = y + D[:, None] * x.reshape(length, heads, p)
    y_ref, final_ref = recurrent(x.reshape(length, heads, p), dtd, A, B.reshape(length, g, n),
                                 C.reshape(length, g, n), D, states[0])
    assert rel_err(y, y_ref) < 1e-5 and rel_err(final, final_ref) < 1e-5


def test_naive_chunked_equals_transformers_torch_ssd():
    from transformers.models.nemotron_h import modeling_nemotron_h as hf

    length, heads, p, g, n, chunk = 21, 4, 8, 2, 16, 8
    xbc, dt, A, D, dt_bias, states = make_inputs(length, heads, p, g, n, 1, seed=3)
    x, B, C = split(xbc, heads, p, g, n)
    ref_y, ref_state = hf.mamba2_chunk_scan(  # transformers' torch SSD (mamba_ssm is not installed here)
        x.reshape(1, length, heads, p), dt[None], A, B.reshape(1, length, g, n), C.reshape(1, length, g, n),
        chunk_size=chunk, D=D, dt_bias=dt_bias, initial_states=states[:1].clone(), dt_softplus=True,
        dt_limit=(1e-3, float("inf")), return_final_states=True,
    )
    pool = states.clone()
    y = ssd_chunk_scan_ref(x.reshape(length, heads, p), dt, A, B.reshape(length, g, n), C.reshape(length, g, n),
                           D, dt_bias, 1e-3, chunk, [0, length], pool, torch.tensor([0]))
    assert rel_err(y, ref_y[0]) < 1e-5
    assert rel_err(pool[0], ref_state[0]) < 1e-5


# serial: one program walks a sequence's chunks; chunked: chunk states, the state hand-over, chunk outputs
PATHS = {"serial": {"chunked_min_tokens": 1 << 30}, "chunked": {"chunked_min_tokens": 0}}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("heads,p,g,n", [(4, 8, 2, 16), (6, 20, 3, 24), (2, 64, 1, 128)])
def test_triton_scan_matches_naive_varlen(heads, p, g, n, path):
    """Packed sequences of 1, 70 (4 full chunks and a part), 5, 0 and 33 tokens, from and into their slots."""
    lengths = [1, 70, 5, 0, 33] if p < 64 else [1, 40]
    cu = [0]
    for ln in lengths:
        cu.append(cu[-1] + ln)
    total = cu[-1]
    slots = torch.tensor([3, 0, 5, 1, 2][: len(lengths)])
    xbc, dt, A, D, dt_bias, states = make_inputs(total, heads, p, g, n, 6, seed=heads)
    x, B, C = split(xbc, heads, p, g, n)
    pool_ref, pool_tri = states.clone(), states.clone()
    y_ref = ssd_chunk_scan_ref(x.reshape(total, heads, p), dt, A, B.reshape(total, g, n), C.reshape(total, g, n),
                               D, dt_bias, 1e-3, 16, cu, pool_ref, slots)
    y = tri_scan.ssd_chunk_scan(x, B, C, dt, torch.log(-A), D, dt_bias, 1e-3, torch.tensor(cu, dtype=torch.int32),
                                pool_tri, slots, heads, p, config={"CHUNK": 16, "BLOCK_P": 16, "PASS_P": 8,
                                                                   **PATHS[path]})
    assert rel_err(y.reshape(total, heads, p), y_ref) < 1e-5
    assert rel_err(pool_tri, pool_ref) < 1e-5
    untouched = [s for s in range(6) if s not in slots.tolist()]
    assert torch.equal(pool_tri[untouched], states[untouched])


@pytest.mark.parametrize("path", PATHS)
def test_triton_scan_half_precision_close(path):
    """fp16 operands, fp32 state (bf16 is checked on the GPU: the interpreter's bf16 tl.dot is not numpy-exact)."""
    heads, p, g, n = 4, 16, 2, 32
    cu = [0, 50, 51]
    xbc, dt, A, D, dt_bias, states = make_inputs(51, heads, p, g, n, 2, seed=9, dtype=torch.float16)
    x, B, C = split(xbc, heads, p, g, n)
    pool_ref, pool_tri = states.clone(), states.clone()
    y_ref = ssd_chunk_scan_ref(x.reshape(51, heads, p), dt, A, B.reshape(51, g, n), C.reshape(51, g, n), D,
                               dt_bias, 1e-3, 16, cu, pool_ref, torch.tensor([1, 0]))
    y = tri_scan.ssd_chunk_scan(x, B, C, dt, torch.log(-A), D, dt_bias, 1e-3, torch.tensor(cu, dtype=torch.int32),
                                pool_tri, torch.tensor([1, 0]), heads, p,
                                config={"CHUNK": 16, "BLOCK_P": 16, **PATHS[path]})
    assert rel_err(y.reshape(51, heads, p), y_ref) < 2e-2
    assert rel_err(pool_tri, pool_ref) < 2e-2


def decode_inputs(batch: int, heads: int, p: int, g: int, n: int, kw: int, bias: bool, slots_n: int, seed: int = 0,
                  dtype=torch.float32):
    """One decode step's kernel arguments (fresh random inputs) and the pools they update."""
    xbc, dt, A, D, dt_bias, states = make_inputs(batch, heads, p, g, n, slots_n, seed=seed, dtype=dtype)
    gen = torch.Generator().manual_seed(seed + kw)
    conv_dim = xbc.shape[1]
    w = torch.randn(conv_dim, kw, generator=gen).to(dtype)
    b = torch.randn(conv_dim, generator=gen).to(dtype) if bias else None
    conv = torch.randn(slots_n, conv_dim, kw - 1, generator=gen).to(dtype)
    z = torch.randn(batch, heads * p, generator=gen).to(dtype)
    norm_w = torch.randn(heads * p, generator=gen).to(dtype)
    return dict(xbc=xbc, z=z, dt=dt, w=w, b=b, A=A, D=D, dt_bias=dt_bias, norm_w=norm_w), conv, states


def decode_ref(a: dict, conv: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, heads: int, p: int, g: int,
               n: int) -> torch.Tensor:
    """The three references in a row (updates ``conv`` and ``pool`` in place) -> [B, H·P] float32."""
    from armillary.kernels.norm import gated_rms_norm

    batch = a["xbc"].shape[0]
    act = causal_conv1d_update_ref(a["xbc"], a["w"], a["b"], conv, slots)
    x, B, C = split(act, heads, p, g, n)
    y = selective_state_update_ref(x.reshape(batch, heads, p), a["dt"], a["A"], B.reshape(batch, g, n),
                                   C.reshape(batch, g, n), a["D"], a["dt_bias"], 1e-3, pool, slots)
    return gated_rms_norm(y.reshape(batch, heads * p), a["z"].float(), a["norm_w"].float(), 1e-5,
                          group_size=heads * p // g, norm_before_gate=False)


def decode_tri(a: dict, conv: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, heads: int, p: int,
               config: dict | None = None) -> torch.Tensor:
    return tri_decode.mamba_decode_step(a["xbc"], a["z"], a["dt"], a["w"], a["b"], conv, torch.log(-a["A"]), a["D"],
                                        a["dt_bias"],
                                        1e-3, a["norm_w"], 1e-5, pool, slots, heads, p, config=config)


DECODE_SHAPES = [(4, 8, 2, 16, 4, True), (6, 20, 3, 24, 3, False), (3, 16, 1, 8, 4, True), (8, 64, 8, 32, 4, True),
                 (5, 12, 5, 8, 2, False), (9, 8, 3, 8, 4, True)]  # odd heads per group (3, 1, 3) and conv widths


@pytest.mark.parametrize("heads,p,g,n,kw,bias", DECODE_SHAPES)
def test_fused_decode_step_matches_naive(heads, p, g, n, kw, bias):
    """Conv update + state update + grouped gated norm in one kernel against the three references;
    the slots the batch does not name stay untouched."""
    args, conv, states = decode_inputs(3, heads, p, g, n, kw, bias, 5, seed=heads * p)
    slots = torch.tensor([4, 0, 2])
    conv_ref, pool_ref, conv_tri, pool_tri = conv.clone(), states.clone(), conv.clone(), states.clone()
    ref = decode_ref(args, conv_ref, pool_ref, slots, heads, p, g, n)
    got = decode_tri(args, conv_tri, pool_tri, slots, heads, p)
    assert rel_err(got, ref) < 1e-5
    assert torch.equal(conv_tri, conv_ref) and rel_err(pool_tri, pool_ref) < 1e-6
    assert torch.equal(conv_tri[[1, 3]], conv[[1, 3]]) and torch.equal(pool_tri[[1, 3]], states[[1, 3]])


@pytest.mark.parametrize("heads,p,g,n,kw,bias", [DECODE_SHAPES[1], DECODE_SHAPES[5]])
def test_fused_decode_steps_in_a_row(heads, p, g, n, kw, bias):
    """Five launches on the same pools (each reads what the previous one wrote), the batch's slot order
    changing between steps and one sequence leaving: every step's output, window and state as the references'."""
    _, conv, states = decode_inputs(1, heads, p, g, n, kw, bias, 6, seed=1)
    conv_ref, pool_ref, conv_tri, pool_tri = conv.clone(), states.clone(), conv.clone(), states.clone()
    for step, order in enumerate(([5, 1, 3], [1, 3, 5], [3, 5, 1], [5, 3], [3, 5])):
        slots = torch.tensor(order)
        args, _, _ = decode_inputs(len(order), heads, p, g, n, kw, bias, 1, seed=10 + step)
        ref = decode_ref(args, conv_ref, pool_ref, slots, heads, p, g, n)
        got = decode_tri(args, conv_tri, pool_tri, slots, heads, p)
        assert rel_err(got, ref) < 1e-5, step
        assert torch.equal(conv_tri, conv_ref) and rel_err(pool_tri, pool_ref) < 1e-6, step
    assert torch.equal(pool_tri[[0, 2, 4]], states[[0, 2, 4]])


def test_fused_decode_step_padding_rows_share_a_scratch_slot():
    """A CUDA-graph batch: the live rows' slots once each, the padding rows all on the scratch slot;
    the live rows' outputs, windows and states are those of the live rows alone."""
    heads, p, g, n, kw = 6, 20, 3, 24, 4
    args, conv, states = decode_inputs(6, heads, p, g, n, kw, True, 5, seed=4)
    live, scratch = torch.tensor([3, 1, 2]), 0
    conv_ref, pool_ref, conv_tri, pool_tri = conv.clone(), states.clone(), conv.clone(), states.clone()
    ref = decode_ref({k: v[:3] if k in ("xbc", "z", "dt") else v for k, v in args.items()}, conv_ref, pool_ref, live,
                     heads, p, g, n)
    got = decode_tri(args, conv_tri, pool_tri, torch.cat([live, torch.full((3,), scratch)]), heads, p)
    assert rel_err(got[:3], ref) < 1e-5
    assert torch.equal(conv_tri[1:], conv_ref[1:]) and rel_err(pool_tri[1:], pool_ref[1:]) < 1e-6
    assert torch.equal(pool_tri[4], states[4]) and torch.equal(conv_tri[4], conv[4])


def test_fused_decode_step_half_precision_window():
    """fp16 activations and conv windows (the model dtype), fp32 states: windows exact, the rest close."""
    heads, p, g, n, kw = 4, 16, 2, 16, 4
    args, conv, states = decode_inputs(2, heads, p, g, n, kw, True, 3, seed=8, dtype=torch.float16)
    slots = torch.tensor([2, 0])
    conv_ref, pool_ref, conv_tri, pool_tri = conv.clone(), states.clone(), conv.clone(), states.clone()
    ref = decode_ref(args, conv_ref, pool_ref, slots, heads, p, g, n)
    got = decode_tri(args, conv_tri, pool_tri, slots, heads, p)
    assert got.dtype == torch.float16 and rel_err(got, ref) < 2e-3
    assert torch.equal(conv_tri, conv_ref) and rel_err(pool_tri, pool_ref) < 1e-3


def test_fused_decode_step_reads_column_views():
    """xbc, z and dt as column views of one in_proj output row (what the mixer passes)."""
    heads, p, g, n = 4, 8, 2, 16
    d_inner, conv_dim = heads * p, heads * p + 2 * g * n
    gen = torch.Generator().manual_seed(3)
    projected = torch.randn(2, d_inner + conv_dim + heads, generator=gen)
    z, xbc, dt = projected.split([d_inner, conv_dim, heads], dim=-1)
    w, conv = torch.randn(conv_dim, 4, generator=gen), torch.randn(2, conv_dim, 3, generator=gen)
    A, D, dt_bias = -torch.rand(heads, generator=gen), torch.randn(heads, generator=gen), torch.zeros(heads)
    states, norm_w = torch.randn(2, heads, p, n, generator=gen), torch.ones(d_inner)
    slots = torch.tensor([1, 0])
    A_log = torch.log(-A)
    views = tri_decode.mamba_decode_step(xbc, z, dt, w, None, conv.clone(), A_log, D, dt_bias, 0.0, norm_w, 1e-5,
                                         states.clone(), slots, heads, p)
    copies = tri_decode.mamba_decode_step(xbc.contiguous(), z.contiguous(), dt.contiguous(), w, None, conv.clone(),
                                          A_log, D, dt_bias, 0.0, norm_w, 1e-5, states.clone(), slots, heads, p)
    assert torch.equal(views, copies)


def test_decode_step_equals_a_one_token_scan():
    heads, p, g, n = 4, 8, 2, 16
    xbc, dt, A, D, dt_bias, states = make_inputs(2, heads, p, g, n, 3, seed=11)
    x, B, C = split(xbc, heads, p, g, n)
    slots = torch.tensor([2, 1])
    a, b = states.clone(), states.clone()
    y_step = selective_state_update_ref(x.reshape(2, heads, p), dt, A, B.reshape(2, g, n), C.reshape(2, g, n), D,
                                        dt_bias, 1e-3, a, slots)
    y_scan = ssd_chunk_scan_ref(x.reshape(2, heads, p), dt, A, B.reshape(2, g, n), C.reshape(2, g, n), D, dt_bias,
                                1e-3, 8, [0, 1, 2], b, slots)
    assert rel_err(y_step, y_scan) < 1e-6 and rel_err(a, b) < 1e-6
    assert F.softplus(torch.tensor(-30.0)).item() < 1e-3  # dt_min matters only for very negative dt


# (split_p, shapes): blocks of 4 leave P = 20 / 12 five / three full blocks; 8 leaves P = 20 a partial third
# block; 16 cuts P = 64 in four and makes every group of (5, 12, 5, 8) one program (one head, one block: no ticket)
SPLITS = [(4, [s for i, s in enumerate(DECODE_SHAPES) if i != 3]), (8, [DECODE_SHAPES[1], DECODE_SHAPES[5]]),
          (16, [DECODE_SHAPES[3], DECODE_SHAPES[4]])]
SPLIT_CASES = [(split, *shape) for split, shapes in SPLITS for shape in shapes]


@pytest.mark.parametrize("split,heads,p,g,n,kw,bias", SPLIT_CASES)
def test_row_split_decode_matches_naive(split, heads, p, g, n, kw, bias):
    """The row-split launch (programs per head and block of state rows, tickets for the group's B / C windows
    and norm) against the references; untouched slots stay; tickets back at zero; a repeat is bit-identical."""
    from armillary.kernels.triton.device_buffers import ticket_buffer

    args, conv, states = decode_inputs(3, heads, p, g, n, kw, bias, 5, seed=heads * p + split)
    slots = torch.tensor([4, 0, 2])
    conv_ref, pool_ref, conv_tri, pool_tri = conv.clone(), states.clone(), conv.clone(), states.clone()
    ref = decode_ref(args, conv_ref, pool_ref, slots, heads, p, g, n)
    cfg = {"split_p": split, "num_warps": 1}
    got = decode_tri(args, conv_tri, pool_tri, slots, heads, p, config=cfg)
    assert rel_err(got, ref) < 1e-5
    assert torch.equal(conv_tri, conv_ref) and rel_err(pool_tri, pool_ref) < 1e-6
    assert torch.equal(conv_tri[[1, 3]], conv[[1, 3]]) and torch.equal(pool_tri[[1, 3]], states[[1, 3]])
    assert not ticket_buffer(torch.device("cpu"), 0).any()
    again_conv, again_pool = conv.clone(), states.clone()
    again = decode_tri(args, again_conv, again_pool, slots, heads, p, config=cfg)
    assert torch.equal(again, got) and torch.equal(again_pool, pool_tri) and torch.equal(again_conv, conv_tri)


def test_row_split_steps_in_a_row_and_padding_rows():
    """Row split over five launches on the same pools (slot order changing, a sequence leaving), then a
    graph-shaped batch whose padding rows share the scratch slot: live rows as the references'."""
    heads, p, g, n, kw, bias = DECODE_SHAPES[5]
    cfg = {"split_p": 8, "num_warps": 1}  # one block per head, three heads per group: the tickets still count
    _, conv, states = decode_inputs(1, heads, p, g, n, kw, bias, 6, seed=2)
    conv_ref, pool_ref, conv_tri, pool_tri = conv.clone(), states.clone(), conv.clone(), states.clone()
    for step, order in enumerate(([5, 1, 3], [1, 3, 5], [3, 5, 1], [5, 3], [3, 5])):
        slots = torch.tensor(order)
        args, _, _ = decode_inputs(len(order), heads, p, g, n, kw, bias, 1, seed=20 + step)
        ref = decode_ref(args, conv_ref, pool_ref, slots, heads, p, g, n)
        got = decode_tri(args, conv_tri, pool_tri, slots, heads, p, config=cfg)
        assert rel_err(got, ref) < 1e-5, step
        assert torch.equal(conv_tri, conv_ref) and rel_err(pool_tri, pool_ref) < 1e-6, step
    args, _, _ = decode_inputs(5, heads, p, g, n, kw, bias, 1, seed=40)
    live = torch.tensor([3, 1])
    ref = decode_ref({k: v[:2] if k in ("xbc", "z", "dt") else v for k, v in args.items()}, conv_ref, pool_ref, live,
                     heads, p, g, n)
    got = decode_tri(args, conv_tri, pool_tri, torch.cat([live, torch.zeros(3, dtype=live.dtype)]), heads, p,
                     config=cfg)
    assert rel_err(got[:2], ref) < 1e-5
    assert torch.equal(conv_tri[1:], conv_ref[1:]) and rel_err(pool_tri[1:], pool_ref[1:]) < 1e-6


def test_row_split_equals_group_walk_half_precision():
    """fp16 activations and windows: the two launch shapes agree (windows exactly, outputs to fp16 rounding)."""
    heads, p, g, n, kw = 4, 16, 2, 16, 4
    args, conv, states = decode_inputs(2, heads, p, g, n, kw, True, 3, seed=8, dtype=torch.float16)
    slots = torch.tensor([2, 0])
    conv_a, pool_a, conv_b, pool_b = conv.clone(), states.clone(), conv.clone(), states.clone()
    walk = decode_tri(args, conv_a, pool_a, slots, heads, p, config={"split_p": 0})
    split = decode_tri(args, conv_b, pool_b, slots, heads, p, config={"split_p": 8})
    assert split.dtype == torch.float16 and rel_err(split, walk) < 2e-3
    assert torch.equal(conv_a, conv_b) and rel_err(pool_a, pool_b) < 1e-6


@pytest.mark.parametrize("batch", [1, 2, 3, 8])
def test_table_picks_the_row_split_at_decode_batches(batch, monkeypatch):
    """The sm_90 table's Nano entry (P 64, N 128, swept on the H200) splits the rows at batch 1..8; a
    caller's config overrides it."""
    from armillary.kernels import tuning

    monkeypatch.setattr(tuning, "device_target", lambda device=None: "sm_90")
    monkeypatch.setattr(tuning, "gpu_name", lambda device=None: None)
    assert tri_decode.decode_config(batch, 64, 128, torch.device("cpu"))["split_p"] > 0
    assert tri_decode.decode_config(batch, 64, 128, torch.device("cpu"), {"split_p": 4})["split_p"] == 4


@pytest.mark.parametrize("batch,split", [(1, 16), (2, 32), (8, 32), (9, 0), (64, 0)])
def test_by_batch_takes_the_smallest_key_at_or_above_the_batch(batch, split, monkeypatch):
    from armillary.kernels import tuning

    table = {"mamba_decode": {"default": {"num_warps": 2}, "p64_n128": {"split_p": 0, "by_batch": {
        "1": {"split_p": 16}, "8": {"split_p": 32}}}}}
    monkeypatch.setattr(tuning, "device_target", lambda device=None: "sm_90")
    monkeypatch.setattr(tuning, "gpu_name", lambda device=None: None)
    monkeypatch.setattr(tuning, "load_table", lambda package, target: table if package == "armillary_nemotron" else {})
    cfg = tri_decode.decode_config(batch, 64, 128, torch.device("cpu"))
    assert cfg["split_p"] == split and cfg["num_warps"] == 2
