"""GLM-4.7-Flash decode-step kernels around the MLA attention at the real sizes (GPU, bf16), for
``glm_flash_gpu_checks.py``: each against its float32 reference, then timed in a CUDA graph against the
torch / cuBLAS ops it replaces (same run), with an optional launch-config sweep.

- ``mla_absorb_rope_store``: rope / norm / latent store + q_nope through W_UK [20, 192, 512], one launch
  (was ``mla_rope_store`` + a per-head ``bmm``);
- ``mla_decode_values``: the decode kernel, then the split combine + W_UV [20, 256, 512] into o_proj's
  [B, 5120] (was ``mla_decode`` (split + combine) + a per-head ``bmm`` + the layout copy);
- ``router_logits``: bf16 x [B, 2048] · float32 W [64, 2048] (was a cast + a cuBLAS GEMV);
- ``norm_gemv`` (B <= 8): q_a_layernorm inside the q_b_proj GEMV [5120, 768] (was rms_norm + the skinny GEMM);
- ``router_topk`` (B <= 8): the router's logits and sigmoid / bias top-k in one launch (was router_logits +
  sigmoid_topk), ids checked equal to the pair's.
"""
from __future__ import annotations

import itertools
import json

import torch
import torch.nn.functional as F

from armillary_glm_flash.ops.mla import absorb, expand
from armillary_glm_flash.ops.mla.decode import decode_config, mla_decode
from armillary_glm_flash.ops.mla.naive import absorb_query, expand_values, mla_decompressed_ref, rope_store_ref
from armillary_glm_flash.ops.mla.rope_store import mla_rope_store
from armillary_glm_flash.ops.router import router_config, router_logits, router_logits_ref

HEADS, DL, DR, NOPE, V, HIDDEN, EXPERTS = 20, 512, 64, 192, 256, 2048, 64
GRAPH_MAX_LEN = 16384 + 512  # the bench's max_model_len: the bound a captured decode step passes
BATCHES = (1, 8, 64)
SEQ_CASES = ([1], [1000], [3, 4097, 16384], [513] * 64)
TIME_CONTEXT = 1024  # the timed decode steps' context
DEVICE = "cuda"  # module globals: a CPU smoke run of the driver may shrink them
# the tables' kernel names and keys (``absorb_config`` / ``expand_config`` / ``router_config``), rows m
TABLE_KEYS = {"absorb": ("mla_absorb", f"h{HEADS}_n{NOPE}_d{DL}_m{{m}}"),
              "values": ("mla_expand", f"h{HEADS}_v{V}_d{DL}_m{{m}}"),
              "router": ("router_logits", f"e{EXPERTS}_k{HIDDEN}_m{{m}}")}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def _store_inputs(tokens: int, seed: int = 0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(tokens, HEADS, NOPE + DR, device=DEVICE, generator=g).to(torch.bfloat16)
    ckv = torch.randn(tokens, DL + DR, device=DEVICE, generator=g).to(torch.bfloat16)
    norm_w = (1 + 0.1 * torch.randn(DL, device=DEVICE, generator=g)).to(torch.bfloat16)
    angles = torch.rand(tokens, DR // 2, device=DEVICE, generator=g) * 6
    kv = torch.zeros(tokens * 2 + 4, 16, DL + DR, dtype=torch.bfloat16, device=DEVICE)
    slots = torch.randperm(kv.shape[0] * 16, device=DEVICE, generator=g)[:tokens]
    return q, ckv, norm_w, angles.cos(), angles.sin(), kv, slots


def check_step_kernels(paged, report) -> None:
    """Each new kernel at the real sizes against its float32 reference (``paged``: the checks' paged-cache maker)."""
    scale = (NOPE + DR) ** -0.5
    for tokens in BATCHES:
        q, ckv, norm_w, cos, sin, kv, slots = _store_inputs(tokens)
        w = (torch.randn(HEADS * (NOPE + V), DL, device=DEVICE) * DL ** -0.5).to(torch.bfloat16)
        w_uk = w.view(HEADS, NOPE + V, DL)[:, :NOPE]
        q_ref, kv_ref = q.clone(), kv.clone()
        rope_store_ref(q_ref, ckv, norm_w, 1e-6, cos, sin, kv_ref, slots, True)
        want = absorb_query(q_ref[..., :NOPE].float(), w_uk.float())
        got = absorb.mla_absorb_rope_store(q, w_uk, ckv, norm_w, 1e-6, cos, sin, kv, slots, True)
        err = _rel(got, want)
        cache_err = _rel(kv, kv_ref)
        q_err = _rel(q, q_ref)
        ok = err < 1e-2 and cache_err < 1e-2 and q_err < 1e-2
        report(f"mla_absorb_rope_store bf16 T={tokens}", ok, f"q_lat relative error {err:.2e}, cache rows "
               f"{cache_err:.2e}, rotated q {q_err:.2e} vs the fp32 references", error=err)
    for seq_lens in SEQ_CASES:
        kv, tables, lat, pe, q_nope, q_pe, w = paged(seq_lens, torch.bfloat16)
        wh = w.view(HEADS, NOPE + V, DL)
        q_lat = absorb_query(q_nope, wh[:, :NOPE])
        lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
        want = torch.stack([mla_decompressed_ref(q_nope[b:b + 1].float(), q_pe[b:b + 1].float(), lat[b].float(),
                                                 pe[b].float(), w.float(), scale)[0] for b in range(len(seq_lens))])
        for max_len in (max(seq_lens), GRAPH_MAX_LEN):  # as eager steps and as a captured bucket call it
            got = expand.mla_decode_values(q_lat, q_pe, kv, tables, lens, scale, max_len, wh[:, NOPE:])
            err = _rel(got.view(len(seq_lens), HEADS, V), want)
            report(f"mla_decode_values bf16 B={len(seq_lens)} max_len={max(seq_lens)} bound={max_len}", err < 2e-2,
                   f"relative error {err:.2e} vs the fp32 decompressed reference", error=err)
    for tokens in BATCHES:
        x = torch.randn(tokens, HIDDEN, device=DEVICE).to(torch.bfloat16)
        wr = torch.randn(EXPERTS, HIDDEN, device=DEVICE) * HIDDEN ** -0.5
        err = _rel(router_logits(x, wr), router_logits_ref(x, wr))
        report(f"router_logits T={tokens}", err < 1e-5, f"relative error {err:.2e} vs fp32 x.float() @ w.T", error=err)


def time_step_kernels(paged, report, time_graph, sweep: bool) -> None:
    """Each replaced op chain and its kernel, in a CUDA graph, same run; ``--sweep`` tries launch configs."""
    scale = (NOPE + DR) ** -0.5
    picks: dict[str, dict[str, dict]] = {"mla_absorb": {}, "mla_expand": {}, "router_logits": {}}
    for batch in BATCHES:
        q, ckv, norm_w, cos, sin, kv_s, slots = _store_inputs(batch)
        kv, tables, _, _, q_nope, q_pe, w = paged([TIME_CONTEXT] * batch, torch.bfloat16)
        wh = w.view(HEADS, NOPE + V, DL)
        w_uk, w_uv = wh[:, :NOPE], wh[:, NOPE:]
        lens = torch.full((batch,), TIME_CONTEXT, dtype=torch.int32, device=DEVICE)
        q_lat = absorb_query(q_nope, w_uk).contiguous()
        decode_cfg = decode_config(HEADS, DL, DR, q.device)

        def old_absorb():
            mla_rope_store(q, ckv, norm_w, 1e-6, cos, sin, kv_s, slots, True)
            return absorb_query(q[..., :NOPE], w_uk)

        def old_values():
            out = expand_values(mla_decode(q_lat, q_pe, kv, tables, lens, scale, GRAPH_MAX_LEN), w_uv)
            return out.reshape(batch, HEADS * V)

        chains = {
            "absorb": (old_absorb, lambda cfg: absorb.mla_absorb_rope_store(
                q, w_uk, ckv, norm_w, 1e-6, cos, sin, kv_s, slots, True, config=cfg),
                absorb.absorb_config(HEADS, NOPE, DL, batch, q.device), HEADS * NOPE * DL * 2,
                [dict(absorb.DEFAULTS, BLOCK_D=d, BLOCK_K=k, num_warps=wp, num_stages=st)
                 for d, k, wp, st in itertools.product((32, 64, 128), (32, 64), (2, 4, 8), (1, 2, 3))]),
            # a values config may carry the decode launch's split_live_min_tokens (an ``mla_decode`` table entry)
            "values": (old_values, lambda cfg: expand.mla_decode_values(
                q_lat, q_pe, kv, tables, lens, scale, GRAPH_MAX_LEN, w_uv, expand_cfg=cfg,
                decode_cfg={**decode_cfg, **{k: v for k, v in cfg.items() if k == "split_live_min_tokens"}}),
                expand.expand_config(HEADS, V, DL, batch, q.device),
                HEADS * V * DL * 2 + batch * TIME_CONTEXT * (DL + DR) * 2,
                [dict(expand.DEFAULTS, BLOCK_V=bv, tile_elements=te, num_warps=wp, num_stages=st, split_live_min_tokens=sm)
                 for bv, te, wp, st, sm in itertools.product((32, 64, 128, 256), (4096, 8192), (4, 8), (1, 2),
                                                             (0, 32, 64, 128, 256))]),
        }
        x = torch.randn(batch, HIDDEN, device=DEVICE).to(torch.bfloat16)
        wr = torch.randn(EXPERTS, HIDDEN, device=DEVICE)
        from armillary_glm_flash.ops import router as router_ops

        chains["router"] = (lambda: F.linear(x.float(), wr), lambda cfg: router_logits(x, wr, config=cfg),
                            router_ops.router_config(EXPERTS, HIDDEN, batch, x.device), EXPERTS * HIDDEN * 4,
                            [dict(router_ops.DEFAULTS, BLOCK_E=e, BLOCK_K=k, num_warps=wp)
                             for e, k, wp in itertools.product((1, 2, 4), (256, 512, 1024), (2, 4, 8))])
        for name, (old, new, cfg, nbytes, candidates) in chains.items():
            t_old = time_graph(old)
            best = None
            for c in [cfg] + (candidates if sweep else []):
                try:
                    dt = time_graph(lambda: new(c))
                except Exception as exc:  # a config that does not compile or fit
                    print(f"  {name} config {c} failed: {type(exc).__name__}", flush=True)
                    continue
                if best is None or dt < best[0]:
                    best = (dt, c)
            dt, c = best
            table, key = TABLE_KEYS[name]
            picks[table][key.format(m=batch)] = c
            report(f"{name} kernel time B={batch}", None,
                   f"{dt * 1e6:.1f} us vs {t_old * 1e6:.1f} us for the ops it replaces ({t_old / dt:.2f}x), "
                   f"{nbytes / dt / 1e9:.0f} GB/s of weights (values: + latents)"
                   f"{' (best of sweep)' if sweep else ''}",
                   seconds=dt, replaced_seconds=t_old, config=c)
    if sweep:
        print("tuning candidates (entries for armillary_glm_flash/tuning/sm_90.json):", json.dumps(picks), flush=True)


Q_LORA, QB_N, TOPK, SHARED = 768, HEADS * (NOPE + DR), 4, 1
FOLD_BATCHES = (1, 2, 4, 8)  # decode-sized rows: the folded launches serve at most 8


def _router_inputs(tokens: int, seed: int = 0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, device=DEVICE, generator=g).to(torch.bfloat16)
    wr = torch.randn(EXPERTS, HIDDEN, device=DEVICE, generator=g) * HIDDEN ** -0.5
    bias = torch.randn(EXPERTS, device=DEVICE, generator=g) * 0.05
    return x, wr, bias


def _qb_inputs(tokens: int, seed: int = 0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q_a = torch.randn(tokens, Q_LORA + DL + DR, device=DEVICE, generator=g).to(torch.bfloat16)[:, :Q_LORA]
    norm_w = (1 + 0.3 * torch.randn(Q_LORA, device=DEVICE, generator=g)).to(torch.bfloat16)
    w = (torch.randn(QB_N, Q_LORA, device=DEVICE, generator=g) * Q_LORA ** -0.5).to(torch.bfloat16)
    return q_a, norm_w, w


def check_fold_kernels(report) -> None:
    """The folded decode launches at the real sizes: ``norm_gemv`` (q_a_layernorm + q_b_proj [5120, 768]) against
    its float32 reference and the unfused pair; ``router_topk`` (logits + top-k) against router_logits + the
    Triton sigmoid_topk (ids equal, weights within 1e-6)."""
    from armillary.kernels.norm import rms_norm
    from armillary.kernels.triton.moe_routing import topk_sigmoid_bias
    from armillary_glm_flash.ops.norm_gemv import norm_gemv, norm_gemv_ref
    from armillary_glm_flash.ops.router_topk import router_topk

    for tokens in FOLD_BATCHES:
        q_a, norm_w, w = _qb_inputs(tokens)
        want = norm_gemv_ref(q_a, norm_w, 1e-6, w)
        err = _rel(norm_gemv(q_a, norm_w, 1e-6, w), want)
        pair_err = _rel(rms_norm(q_a, norm_w, 1e-6) @ w.t(), want)  # what the unfused bf16 pair makes of it
        report(f"norm_gemv bf16 T={tokens}", err < 1e-2 and err <= 2 * pair_err + 1e-3,
               f"relative error {err:.2e} vs the fp32 reference (rms_norm + bf16 GEMM: {pair_err:.2e})", error=err)
        x, wr, bias = _router_inputs(tokens)
        x[0] = 0.0  # every logit 0 in one row: ties broken by the bias alone
        bias[1] = bias[0]  # and two experts tied outright there
        want_w, want_ids = topk_sigmoid_bias(router_logits(x, wr), bias, TOPK, True, 1.8, SHARED)
        got_w, got_ids = router_topk(x, wr, bias, TOPK, True, 1.8, SHARED)
        same = torch.equal(got_ids, want_ids.to(torch.int32))
        werr = (got_w - want_w).abs().max().item()
        report(f"router_topk T={tokens}", same and werr < 1e-6,
               f"ids {'equal' if same else 'DIFFER'} to router_logits + sigmoid_topk, weights max diff {werr:.1e}",
               error=werr)


def time_fold_kernels(report, time_graph, sweep: bool) -> None:
    """Each folded launch against the pair it replaces, in a CUDA graph, same run; ``--sweep`` tries configs."""
    from armillary.kernels import ops, tuning
    from armillary.kernels.triton import skinny_gemm as tri_sg
    from armillary.kernels.triton.moe_routing import topk_sigmoid_bias
    from armillary_glm_flash.ops import norm_gemv as ng
    from armillary_glm_flash.ops.router_topk import router_topk

    picks: dict[str, dict[str, dict]] = {"norm_gemv": {}}
    with tuning.overlay("armillary_glm_flash"):  # the pair as the served model configures it
        for batch in FOLD_BATCHES:
            q_a, norm_w, w = _qb_inputs(batch)
            x, wr, bias = _router_inputs(batch)
            skinny = tri_sg.lookup_config(batch, QB_N, Q_LORA, q_a.device)
            key = f"n{QB_N}_k{Q_LORA}_m{batch}"
            chains = {
                "norm_gemv": (lambda: tri_sg.skinny_gemm(ops.rms_norm(q_a, norm_w, 1e-6), w, config=skinny),
                              lambda cfg: ng.norm_gemv(q_a, norm_w, 1e-6, w, config=cfg),
                              ng.norm_gemv_config(batch, QB_N, Q_LORA, q_a.device), QB_N * Q_LORA * 2,
                              [dict(ng.DEFAULTS, path=p, BLOCK_N=bn, BLOCK_K=bk, num_warps=wp, num_stages=st)
                               for p, bn, bk, wp, st in itertools.product(("fma", "dot"), (4, 8, 16, 32, 64),
                                                                           (128, 256), (2, 4, 8), (1, 3))
                               if not (p == "dot" and (bn < 16 or batch == 1))]),  # dot: 16+ columns, rows
                "router_topk": (lambda: topk_sigmoid_bias(router_logits(x, wr), bias, TOPK, True, 1.8, SHARED),
                                lambda cfg: router_topk(x, wr, bias, TOPK, True, 1.8, SHARED, config=cfg),
                                router_config(EXPERTS, HIDDEN, batch, x.device), EXPERTS * HIDDEN * 4, []),
            }
            for name, (old, new, cfg, nbytes, candidates) in chains.items():
                t_old = time_graph(old)
                best = None
                for c in [cfg] + (candidates if sweep else []):
                    try:
                        dt = time_graph(lambda: new(c))
                    except Exception as exc:  # a config that does not compile or fit
                        print(f"  {name} config {c} failed: {type(exc).__name__}", flush=True)
                        continue
                    if best is None or dt < best[0]:
                        best = (dt, c)
                dt, c = best
                if name == "norm_gemv":
                    picks[name][key] = {"use": dt < t_old, **{k: v for k, v in c.items() if k not in ("use", "max_rows")}}
                report(f"{name} kernel time B={batch}", None,
                       f"{dt * 1e6:.1f} us vs {t_old * 1e6:.1f} us for the pair it replaces ({t_old / dt:.2f}x), "
                       f"{nbytes / dt / 1e9:.0f} GB/s of weights{' (best of sweep)' if sweep else ''}",
                       seconds=dt, replaced_seconds=t_old, config=c)
    if sweep:
        print("tuning candidates (norm_gemv entries for armillary_glm_flash/tuning/sm_90.json):", json.dumps(picks),
              flush=True)
