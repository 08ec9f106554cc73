"""Bad GGUF files fail at open with a message naming what is wrong: the tensor and its type, or the
header field being read. Where the failing spot is checked, gguf-py's own reader is the oracle."""
from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from armillary import LLM
from armillary.errors import WeightLoadError
from armillary_llama.gguf_file import GGUFError
from armillary_llama.gguf_source import GGUFSource


def _cut(source, target, size: int):
    with open(source, "rb") as f:
        target.write_bytes(f.read(size))
    return target


@pytest.fixture(scope="module")
def reader(smollm2_gguf) -> gguf.GGUFReader:
    return gguf.GGUFReader(smollm2_gguf)


def test_truncated_file_names_the_tensor_that_runs_past_the_end(smollm2_gguf, reader, tmp_path, llama_registry):
    victim = reader.tensors[len(reader.tensors) // 2]
    cut = int(victim.data_offset) + int(victim.n_bytes) // 2
    path = _cut(smollm2_gguf, tmp_path / "truncated.gguf", cut)
    expected = rf"truncated: tensor '{victim.name}' \({victim.tensor_type.name}, shape .*\) needs bytes .* ends at byte {cut}"
    with pytest.raises(GGUFError, match=expected):
        GGUFSource(str(path))
    # the user-facing path reports the same, as a WeightLoadError the server knows
    with pytest.raises(WeightLoadError, match=expected):
        LLM(model=str(path), registry=llama_registry, dtype="float32")


def test_file_cut_inside_the_header_names_the_field(smollm2_gguf, reader, tmp_path, tiny_llama, gguf_writer):
    field = reader.fields["tokenizer.ggml.merges"]
    path = _cut(smollm2_gguf, tmp_path / "metadata-cut.gguf", field.offset + 5000)
    with pytest.raises(GGUFError, match=r"truncated or corrupt: the value of key 'tokenizer.ggml.merges' claims 48900"):
        GGUFSource(str(path))

    _, hf_model = tiny_llama()
    tiny = gguf_writer(hf_model, tmp_path / "tiny.gguf", Q.F32)
    info = next(t for t in gguf.GGUFReader(tiny).tensors if t.name == "blk.1.ffn_up.weight")
    path = _cut(tiny, tmp_path / "table-cut.gguf", info.field.offset + 8 + len(info.name) + 2)
    with pytest.raises(GGUFError, match="truncated or corrupt: reading the dimension count of tensor 'blk.1.ffn_up.weight'"):
        GGUFSource(str(path))


def test_bad_magic_and_corrupt_tensor_type(smollm2_gguf, tmp_path):
    data = bytearray(smollm2_gguf.read_bytes())
    (tmp_path / "magic.gguf").write_bytes(b"GGML" + data[4:4096])
    with pytest.raises(GGUFError, match="is not a GGUF file: it starts with b'GGML'"):
        GGUFSource(str(tmp_path / "magic.gguf"))

    name = b"blk.3.ffn_up.weight"
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    (n_dims,) = struct.unpack_from("<I", data, at)
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, 99)  # the tensor's ggml type
    (tmp_path / "type.gguf").write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="corrupt GGUF file .*: tensor 'blk.3.ffn_up.weight' has unknown ggml type id 99"):
        GGUFSource(str(tmp_path / "type.gguf"))


def test_unsupported_quant_type_names_tensor_and_type(tmp_path, tiny_llama, gguf_writer, llama_registry):
    _, hf_model = tiny_llama()
    block, size = gguf.constants.GGML_QUANT_SIZES[Q.IQ4_NL]
    raw = {"blk.1.ffn_gate.weight": np.zeros((96, 64 // block * size), dtype=np.uint8)}
    path = gguf_writer(hf_model, tmp_path / "iq4.gguf", Q.Q8_0, types={"blk.1.ffn_gate.weight": Q.IQ4_NL}, raw=raw)
    expected = (r"tensor 'blk.1.ffn_gate.weight' \(IQ4_NL, shape \[96, 64\]\) uses quantization type IQ4_NL, "
                r"which armillary-llama does not dequantize \(supported: F32, F16, Q4_0")
    with pytest.raises(GGUFError, match=expected):
        LLM(model=str(path), registry=llama_registry, dtype="float32")


def test_tensor_outside_dense_llama_is_named(tmp_path, tiny_llama, gguf_writer):
    _, hf_model = tiny_llama()
    path = gguf_writer(hf_model, tmp_path / "moe.gguf", Q.F32, extra={"blk.0.ffn_gate_exps.weight": np.zeros((4, 96, 64))})
    with pytest.raises(GGUFError, match="tensor 'blk.0.ffn_gate_exps.weight' belongs to a mixture-of-experts llama"):
        GGUFSource(str(path))
    path = gguf_writer(hf_model, tmp_path / "extra.gguf", Q.F32, extra={"blk.0.attn_q_norm.weight": np.zeros(16)})
    with pytest.raises(GGUFError, match="tensor 'blk.0.attn_q_norm.weight' is not part of a llama model"):
        GGUFSource(str(path))


def test_other_architectures_are_left_to_other_plugins(tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "qwen2.gguf", "qwen2")
    writer.add_tensor("token_embd.weight", np.zeros((8, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert not GGUFSource.matches(str(tmp_path / "qwen2.gguf"))
    (tmp_path / "garbage.gguf").write_bytes(b"\x00" * 64)
    assert GGUFSource.matches(str(tmp_path / "garbage.gguf"))  # claimed, so that its damage gets reported
    with pytest.raises(GGUFError, match="is not a GGUF file"):
        GGUFSource(str(tmp_path / "garbage.gguf"))
