"""Llama and Mistral through the Triton kernels (the GPU fast path) equal transformers, and a decode-only
step (as a CUDA graph replays it: no host lists) runs without reading ``batch.*_cpu``.

On a machine without CUDA the kernels run in Triton's interpreter (the root conftest sets
TRITON_INTERPRET), so CI checks the kernels' wiring into the model; the models are tiny and the
generations short because the interpreter is slow.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from armillary import LLM, SamplingParams
from armillary.kernels import ops

NEW = 6
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _prompts(vocab: int, lengths: tuple[int, ...]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def _hf_greedy(hf_model, prompt: list[int], new: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                pad_token_id=hf_model.config.eos_token_id)
    return out[0, len(prompt):].tolist()


@pytest.fixture
def triton_backend():
    yield
    ops.set_backend("auto")  # the engine set it from kernel_backend; later tests get the default back


def _mistral(tmp_path, window: int):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=96,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=128, sliding_window=window)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    model.save_pretrained(tmp_path / "mistral")
    return tmp_path / "mistral", model


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter evaluates masked-off lanes too
@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_triton_kernels_match_transformers(arch, tiny_llama, tmp_path, llama_registry, triton_backend):
    if arch == "llama":
        directory, hf_model = tiny_llama("fast", num_hidden_layers=2, attention_bias=True)
        lengths = (7, 21)
    else:  # a window shorter than the prompt, over 8-token blocks
        directory, hf_model = _mistral(tmp_path, window=12)
        lengths = (19, 5)
    prompts = _prompts(hf_model.config.vocab_size, lengths)
    # a 16-token budget mixes chunked prefills (after cached context) with decodes, then decode-only steps
    llm = LLM(str(directory), registry=llama_registry, dtype="float32", device=DEVICE, max_model_len=64,
              block_size=8, max_num_batched_tokens=16, cpu_kv_cache_space_gb=0.01, kernel_backend="triton",
              enforce_eager=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [_hf_greedy(hf_model, p, NEW) for p in prompts]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_decode_only_step_reads_no_host_lists(tiny_llama, llama_registry, triton_backend):
    """A decode-only batch with ``*_cpu = None`` (what a CUDA-graph step carries) gives the hidden states
    the reference kernels give on the same batch with its host lists."""
    directory, _ = tiny_llama("graphless", num_hidden_layers=2)
    # no async scheduling (on by default on CUDA): the prefill step would launch the next decode itself
    llm = LLM(str(directory), registry=llama_registry, dtype="float32", device=DEVICE, max_model_len=64,
              block_size=8, cpu_kv_cache_space_gb=0.01, kernel_backend="triton", enforce_eager=True,
              async_scheduling=False)
    engine = llm.engine
    for i, prompt in enumerate(_prompts(160, (9, 17, 3))):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    engine.step()  # the three prefills
    plan = engine.scheduler.schedule()
    assert len(plan.chunks) == 3 and all(c.is_decode for c in plan.chunks)
    batch = engine.runner.prepare(plan)
    assert batch.is_decode_only
    graph_like = dataclasses.replace(batch, query_start_loc_cpu=None, context_lens_cpu=None, seq_lens_cpu=None)
    with torch.inference_mode():
        fast = engine.model(graph_like)  # [3, H]; writes the step's K/V (the reference run rewrites the same)
        ops.set_backend("reference")
        ref = engine.model(batch)
        with pytest.raises(RuntimeError, match="host lists"):
            engine.model(graph_like)  # the reference path refuses a graph batch instead of misreading it
    torch.testing.assert_close(fast, ref, rtol=1e-4, atol=1e-4)
