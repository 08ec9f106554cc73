"""The fused verify-step GDN kernel against the layer math run one position at a time, each
position's state and conv window checked in the row it must land in; and the prefill gates kernel."""
from __future__ import annotations

import pytest
import torch

from armillary.kernels.triton.device_buffers import ticket_buffer
from armillary_qwen_gdn_moe.ops.gated_delta_rule.fused_verify import fused_gdn_verify
from plugins.qwen_gdn_moe.tests.test_gdn_triton import DEVICE, TOL, _decode_case, _decode_reference, _rel_err


# split_bv 0 maps to whole value-head rows; 8 splits V (tickets for the windows and the row norm)
@pytest.mark.parametrize("H,HV,K,V,dtype,config,batch,drafts", [
    (2, 4, 24, 20, torch.float32, {"split_bv": 0}, 1, 2),
    (2, 4, 24, 20, torch.float32, {"split_bv": 8, "num_warps": 2}, 2, 3),
    (2, 4, 24, 20, torch.float32, {"split_bv": 8}, 3, 1),
    (1, 3, 16, 36, torch.float32, {"split_bv": 16, "num_warps": 1}, 1, 4),
    (3, 3, 16, 20, torch.float32, {"split_bv": 32}, 2, 2),
    (2, 4, 24, 20, torch.float16, {"split_bv": 8}, 1, 2),
])
def test_fused_verify_equals_positions_one_at_a_time(H, HV, K, V, dtype, config, batch, drafts):
    """drafts >= 3 takes position D's conv window wholly from the step's tokens (kernel 4)."""
    gen = torch.Generator().manual_seed(7 * batch + drafts)
    steps = drafts + 1
    num_rows = batch * steps + 2
    params, conv_states, ssm_states = _decode_case(H, HV, K, V, dtype, num_rows, gen)
    perm = torch.randperm(num_rows, generator=gen)
    slots, spec = perm[:batch], perm[batch:batch * steps].reshape(batch, drafts)
    mixed = torch.randn(batch, steps, 2 * H * K + 2 * HV * V + 2 * HV, generator=gen).to(dtype)
    ref_conv, ref_ssm = conv_states.clone(), ssm_states.clone()
    dev = {name: t.to(DEVICE) for name, t in params.items()}
    for _ in range(2):  # twice: the tickets must be back at zero after the first launch
        got_conv, got_ssm = conv_states.to(DEVICE, copy=True), ssm_states.to(DEVICE, copy=True)
        out = fused_gdn_verify(mixed.reshape(batch * steps, -1).to(DEVICE), dev["conv_weight"], got_conv, got_ssm,
                               dev["A_log"], dev["dt_bias"], dev["norm_weight"], 1e-6, slots.to(DEVICE),
                               spec.to(DEVICE), H, K, V, config=config)
        assert out.shape == (batch * steps, HV * V) and out.dtype == dtype
        assert not ticket_buffer(torch.device(DEVICE), 0).any()
    out = out.reshape(batch, steps, HV * V).cpu()
    chain_conv, chain_ssm = ref_conv.clone(), ref_ssm.clone()
    for i in range(steps):  # the reference walks the slot in place; each position's result is copied aside
        ref = _decode_reference(mixed[:, i], params["conv_weight"], chain_conv, chain_ssm, params["A_log"],
                                params["dt_bias"], params["norm_weight"], slots, H, K, V)
        assert _rel_err(out[:, i], ref) < TOL[dtype], i
        dst = spec[:, i] if i < drafts else slots
        assert torch.equal(got_conv.cpu()[dst], chain_conv[slots]), i
        assert _rel_err(got_ssm.cpu()[dst], chain_ssm[slots]) < TOL[dtype], i
    untouched = perm[batch * steps:]
    assert torch.equal(got_ssm.cpu()[untouched], ssm_states[untouched])
    assert torch.equal(got_conv.cpu()[untouched], conv_states[untouched])


def test_fused_verify_refuses_strided_rows():
    H, HV, K, V = 2, 4, 16, 16
    gen = torch.Generator().manual_seed(0)
    params, conv_states, ssm_states = _decode_case(H, HV, K, V, torch.float32, 8, gen)
    rows = torch.arange(8).reshape(2, 4)[:, :2]  # [2, 2] with a stride of 4
    mixed = torch.randn(6, 2 * H * K + 2 * HV * V + 2 * HV)
    with pytest.raises(ValueError, match="contiguous"):
        fused_gdn_verify(mixed, params["conv_weight"], conv_states, ssm_states, params["A_log"], params["dt_bias"],
                         params["norm_weight"], 1e-6, torch.tensor([6, 7]), rows, H, K, V)


@pytest.mark.parametrize("T,HV,dtype", [(37, 6, torch.float32), (5, 32, torch.bfloat16), (1, 3, torch.float16)])
def test_gdn_gates_equal_the_torch_formula(T, HV, dtype):
    """beta and the log decay from column views of in_proj's output, softplus's threshold included."""
    from armillary_qwen_gdn_moe.ops.gated_delta_rule.gates import gdn_gates
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(T)
    rows = (torch.randn(T, 10 + 2 * HV, generator=gen) * 8).to(dtype)  # a up to ~±30: both softplus branches
    b, a = rows[:, 10:10 + HV], rows[:, 10 + HV:]
    A_log, dt_bias = torch.randn(HV, generator=gen), torch.randn(HV, generator=gen)
    beta, g = gdn_gates(b.to(DEVICE), a.to(DEVICE), A_log.to(DEVICE), dt_bias.to(DEVICE))
    assert beta.dtype == dtype and g.dtype == torch.float32
    assert _rel_err(beta.cpu(), torch.sigmoid(b)) < {torch.float32: 1e-6}.get(dtype, 1e-2)  # a rounding of the output
    assert _rel_err(g.cpu(), -A_log.exp() * F.softplus(a.float() + dt_bias)) < 1e-5
