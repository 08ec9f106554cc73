"""Sliding-window memory through the engine: a 4K-token prompt with a 64-token window holds at most
``window / block_size + 2`` blocks per sequence in each sliding group at every step (the coordinator's
tables, read during the run), the global groups hold the whole sequence, and the tokens stay
transformers'. Plus the planner's arithmetic for a 32K-token Gemma-3-27B sequence against full
attention in every layer."""
from __future__ import annotations

import pytest
import torch

from armillary import LLM, SamplingParams
from armillary.cache_spec import FullAttention
from armillary.hf_config import HFConfig
from armillary.memory.groups import FullAttentionGroup, SlidingWindowGroup
from armillary.memory.planner import blocks_per_sequence, group_layers, plan_memory
from armillary_gemma.model import Gemma3ForCausalLM, Gemma4ForCausalLM
from plugins.gemma.tests.gemma_hf import CONFIGS, hf_greedy

WINDOW, BLOCK, PROMPT, NEW = 64, 16, 4096, 8


def _held(group, seq) -> int:
    return sum(b != group.null_block for b in group.table(seq)) if isinstance(group, SlidingWindowGroup) \
        else len(group.table(seq))


@pytest.mark.parametrize("name", ["gemma3", "gemma4_moe"])
def test_a_4k_prompt_holds_only_its_window_in_every_sliding_group(name, tmp_path, gemma_registry):
    """Gemma 3 (one page shape) and Gemma 4 (sliding pages packed two per global-sized position)."""
    import transformers

    torch.manual_seed(0)
    config = dict(CONFIGS[name], sliding_window=WINDOW, max_position_embeddings=8192)
    config.pop("enable_moe_block", None)  # dense: the prefill of 4K tokens stays quick on a CPU
    family = "Gemma3" if name == "gemma3" else "Gemma4"
    hf_model = getattr(transformers, f"{family}ForCausalLM")(getattr(transformers, f"{family}TextConfig")(**config))
    hf_model = hf_model.eval()
    hf_model.save_pretrained(tmp_path / name)
    llm = LLM(str(tmp_path / name), registry=gemma_registry, dtype="float32", block_size=BLOCK,
              max_model_len=PROMPT + 64, max_num_batched_tokens=512, max_num_seqs=2, cpu_kv_cache_space_gb=0.2)
    engine = llm.engine
    sliding = [g for g in engine.cache.paged if isinstance(g, SlidingWindowGroup)]
    full = [g for g in engine.cache.paged if type(g) is FullAttentionGroup]
    assert sliding and full  # the packed sliding pages and the global ones
    prompt = torch.randint(3, 160, (PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
    steps, tokens = 0, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
        for seq in engine.scheduler.running:
            steps += 1
            for g in sliding:
                assert _held(g, seq) <= WINDOW // BLOCK + 2, (g.describe(), seq.num_computed_tokens)
            for g in full:
                assert _held(g, seq) == -(-seq.num_computed_tokens // BLOCK) or _held(g, seq) == \
                    -(-len(seq) // BLOCK)
    assert steps >= PROMPT // 512 + NEW - 2  # measured through the prefill chunks and the decodes
    assert engine.cache.pool.num_used == 0
    assert tokens == hf_greedy(hf_model, prompt, NEW).sequences[0, PROMPT:].tolist()


def _gemma3_27b() -> HFConfig:
    return HFConfig({"model_type": "gemma3_text", "hidden_size": 5376, "num_hidden_layers": 62,
                     "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128, "sliding_window": 1024,
                     "intermediate_size": 21504, "query_pre_attn_scalar": 168})


def _kv_ratio(max_chunk: int) -> float:
    """Bytes a 32K-token Gemma-3-27B sequence holds (new tokens per step ``max_chunk``) over full attention's."""
    layout = Gemma3ForCausalLM.cache_layout(_gemma3_27b())
    full = [FullAttention(16, 128)] * 62
    kw = dict(budget_bytes=1 << 40, block_size=16, num_slots=1, dtype=torch.bfloat16, max_model_len=32768,
              max_num_seqs=1, max_chunk=max_chunk)
    windowed, dense = plan_memory(layout, **kw), plan_memory(full, **kw)
    return (blocks_per_sequence(windowed.paged_groups, 16, 32768, max_chunk) * windowed.bytes_per_block) / (
        blocks_per_sequence(dense.paged_groups, 16, 32768, max_chunk) * dense.bytes_per_block)


def test_a_32k_gemma3_27b_sequence_keeps_under_a_quarter_of_full_attention():
    # decoding: 10 global layers keep 32K tokens, 52 sliding ones their 1024-token window (+ a stale block)
    assert _kv_ratio(max_chunk=1) <= 0.20
    # the peak of a 512-token prefill chunk (the window behind the chunk's first query, the chunk)
    assert _kv_ratio(max_chunk=512) <= 0.25


def test_gemma4_31b_packs_two_global_layers_per_sliding_position():
    cfg = HFConfig({"model_type": "gemma4_text", "hidden_size": 5376, "num_hidden_layers": 60,
                    "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 256, "global_head_dim": 512,
                    "num_global_key_value_heads": 4, "attention_k_eq_v": True, "sliding_window": 1024,
                    "hidden_size_per_layer_input": 0})
    groups, _ = group_layers(Gemma4ForCausalLM.cache_layout(cfg), torch.bfloat16)
    globals_ = [g for g in groups if g.window is None]
    assert [len(g.layers) for g in globals_] == [10] and globals_[0].per_position == 2
    assert {len(g.layers) for g in groups if g.window} == {5} and len(groups) == 11  # 50 sliding in 10 of 5
