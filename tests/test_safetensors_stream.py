"""The prefetching safetensors reader: the same tensors as the safetensors library, through the
staged and the direct path, with chunks and batches that straddle tensors and shards; an
unaligned writer; per-shard progress lines; the engine's parameters equal a plain safe_open load."""
from __future__ import annotations

import functools
import json
import logging
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import armillary.weights as weights_mod
from armillary.errors import WeightLoadError
from armillary.model_source import HFDirectory
from armillary.safetensors_stream import plan_reads, read_header, stream_safetensors


def _mixed(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        f"s{seed}.a": torch.randn(7, 13, generator=g),
        f"s{seed}.b": torch.randn(5, 3, generator=g).to(torch.bfloat16),
        f"s{seed}.c": torch.randn(33, generator=g).to(torch.float16),
        f"s{seed}.d": torch.randint(-9, 9, (4, 2), generator=g),
        f"s{seed}.e": torch.rand(11, generator=g) > 0.5,
        f"s{seed}.f": torch.randn(3, 9, generator=g).to(torch.float8_e4m3fn),
        f"s{seed}.g": torch.tensor(2.5),
        f"s{seed}.h": torch.zeros(0, 4),
    }


def _shards(tmp_path, n: int = 3):
    paths, tensors = [], {}
    for i in range(n):
        shard = _mixed(i)
        path = tmp_path / f"model-{i:05d}.safetensors"
        save_file(shard, str(path))
        paths.append(path)
        tensors.update(shard)
    return paths, tensors


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name  # bitwise


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("chunk,batch,slots", [(37, 100, 2), (8, 8, 1), (1 << 20, 1 << 20, 8)])
def test_stream_equals_safetensors(tmp_path, staged, chunk, batch, slots):
    paths, tensors = _shards(tmp_path)
    got = list(stream_safetensors(paths, "cpu", progress=False, batch_bytes=batch, chunk_bytes=chunk,
                                  num_slots=slots, num_readers=3, staged=staged))
    _same(dict(got), tensors)
    in_file_order = [e.name for p in paths for e in read_header(p)]
    assert [n for n, _ in got] == in_file_order


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned staging path with CUDA events needs a GPU")
def test_stream_to_cuda_equals_safetensors(tmp_path):
    paths, tensors = _shards(tmp_path)
    got = list(stream_safetensors(paths, "cuda", progress=False, batch_bytes=100, chunk_bytes=37, num_slots=2))
    assert all(t.device.type == "cuda" for _, t in got)
    _same({n: t.cpu() for n, t in got}, tensors)


def test_plan_covers_every_byte_once(tmp_path):
    paths, _ = _shards(tmp_path, n=2)
    headers = [read_header(p) for p in paths]
    batches, chunks = plan_reads(headers, batch_bytes=64, chunk_bytes=24)
    for i, b in enumerate(batches):
        mine = [c for c in chunks if c.batch == i]
        assert sum(c.nbytes for c in mine) == b.end - b.begin
        assert [c.last_of_batch for c in mine] == [False] * (len(mine) - 1) + [True]
        assert b.end - b.begin <= 64 or len(b.entries) == 1  # one oversize tensor alone
    assert sum(len(b.entries) for b in batches) == sum(len(h) for h in headers)


def test_unaligned_tensor_from_another_writer(tmp_path):
    # a 3-element bf16 tensor first leaves the float32 after it at an odd-of-4 offset
    b = torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16)
    f = torch.tensor([0.1, 0.2], dtype=torch.float32)
    header = {"b": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 6]},
              "f": {"dtype": "F32", "shape": [2], "data_offsets": [6, 14]}}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path = tmp_path / "odd.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text + b.view(torch.uint8).numpy().tobytes()
                     + f.view(torch.uint8).numpy().tobytes())
    for staged in (False, True):
        got = dict(stream_safetensors([path], progress=False, staged=staged))
        assert torch.equal(got["b"], b) and torch.equal(got["f"], f)


def test_truncated_shard_is_an_error(tmp_path):
    paths, _ = _shards(tmp_path, n=1)
    data = paths[0].read_bytes()
    paths[0].write_bytes(data[:-10])
    with pytest.raises(WeightLoadError, match="does not fit"):
        list(stream_safetensors(paths, progress=False))


def test_progress_line_per_shard(tmp_path, caplog):
    paths, _ = _shards(tmp_path, n=2)
    with caplog.at_level(logging.INFO, logger="armillary"):
        list(stream_safetensors(paths, progress=True, chunk_bytes=64, batch_bytes=128))
    lines = [r.getMessage() for r in caplog.records]
    assert any("shard 1/2 model-00000.safetensors" in m and "GB/s" in m for m in lines), lines
    assert any("shard 2/2 model-00001.safetensors" in m for m in lines), lines
    assert any(m.startswith("weights: ") and "from 2 shard(s)" in m for m in lines), lines


def _safe_open_weights(path):
    """The loader before prefetching: safe_open, one shard at a time."""
    for shard in weights_mod.safetensors_shards(path):
        with safe_open(shard, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def test_engine_parameters_equal_a_safe_open_load(tmp_path, monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    import armillary_llama.hooks as llama_hooks
    from armillary.config import EngineConfig
    from armillary.engine import LLMEngine
    from armillary.registry import PluginRegistry

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="20KB")
    assert len(weights_mod.safetensors_shards(tmp_path)) > 2

    def engine():
        registry = PluginRegistry()
        registry.register(llama_hooks, "llama", distribution="armillary-llama")
        cfg = EngineConfig(model=str(tmp_path), dtype="float32", device="cpu", max_model_len=64, num_kv_blocks=8,
                           max_num_seqs=2, warmup=False)
        return LLMEngine(cfg, registry=registry)

    # small staged chunks: reads straddle tensors, batches and shards
    monkeypatch.setattr(weights_mod, "stream_safetensors",
                        functools.partial(stream_safetensors, chunk_bytes=1000, batch_bytes=3000, num_slots=3,
                                          staged=True))
    ours = {n: p.detach().clone() for n, p in engine().model.named_parameters()}
    monkeypatch.setattr(HFDirectory, "weights_on", lambda self, device, progress=True: _safe_open_weights(self.path))
    before = dict(engine().model.named_parameters())
    assert sorted(ours) == sorted(before)
    for name, p in before.items():
        assert torch.equal(ours[name], p), name
    on_disk = load_file(str(weights_mod.safetensors_shards(tmp_path)[0]))
    assert on_disk  # the checkpoint is real bf16 data cast to the float32 model
