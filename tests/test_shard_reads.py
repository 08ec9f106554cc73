"""LazySlice views of safetensors files: narrow and leading-dimension indexing stay lazy and materialise only the
viewed elements (bf16, fp8, fp32; odd shapes), every other operation reads the view and runs on the real tensor, a
parameter copy takes it, the bytes counted; the files are unmapped after."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from armillary import shard_reads


@pytest.fixture()
def stored(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(7, 13, generator=g).bfloat16(), "e": torch.randn(3, 5, 6, generator=g),
               "q": torch.randn(9, 4, generator=g).to(torch.float8_e4m3fn), "n": torch.randn(11, generator=g)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    views = dict(shard_reads.lazy_safetensors([tmp_path / "model.safetensors"]))
    yield tensors, views
    shard_reads.close_maps()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bytes (fp8 compares as uint8: torch.equal has no fp8 kernel)."""
    as_bytes = (lambda t: t.view(torch.uint8)) if a.dtype.itemsize == 1 else (lambda t: t)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(as_bytes(a), as_bytes(b))


def test_metadata_without_reading(stored):
    tensors, views = stored
    before = shard_reads.BYTES_READ[0]
    for name, t in tensors.items():
        v = views[name]
        assert isinstance(v, torch.Tensor) and v.shape == t.shape and v.dtype == t.dtype and v.dim() == t.dim()
        assert v.numel() == t.numel() and v.device == torch.device("cpu") and v.size(0) == t.shape[0]
    assert shard_reads.BYTES_READ[0] == before


@pytest.mark.parametrize("name,ops", [
    ("w", [("narrow", 0, 2, 3)]), ("w", [("narrow", 1, 5, 7)]), ("w", [("narrow", 0, 1, 5), ("narrow", 1, 3, 4)]),
    ("e", [("index", 2)]), ("e", [("index", (1, slice(2, 5)))]),
    ("e", [("index", slice(1, None)), ("narrow", 2, 1, 4)]),
    ("q", [("narrow", 0, 4, 5)]), ("n", [("narrow", 0, 10, 1)]), ("e", [("index", -1)]),
])  # fmt: skip
def test_lazy_views_read_only_their_elements(stored, name, ops):
    tensors, views = stored
    want, got = tensors[name], views[name]
    for op in ops:
        if op[0] == "narrow":
            want, got = want.narrow(*op[1:]), got.narrow(*op[1:])
        else:
            want, got = want[op[1]], got[op[1]]
    assert isinstance(got, shard_reads.LazySlice)
    before = shard_reads.BYTES_READ[0]
    real = got.materialize()
    assert _same(real, want.contiguous()) and real.is_contiguous()
    assert shard_reads.BYTES_READ[0] - before == want.numel() * want.element_size()


def test_other_operations_run_on_the_real_tensor(stored):
    tensors, views = stored
    w, e = tensors["w"], tensors["e"]
    assert torch.equal(views["w"].t().contiguous(), w.t().contiguous())
    assert torch.equal(torch.cat([views["w"], views["w"].narrow(0, 0, 2)]), torch.cat([w, w[:2]]))
    assert torch.equal(views["e"].reshape(-1, 6), e.reshape(-1, 6)) and torch.equal(views["w"].float(), w.float())
    assert torch.equal(views["e"][:, 1], e[:, 1])  # a slice past the leading dimensions: read, then indexed
    param = torch.nn.Parameter(torch.zeros(3, 13, dtype=torch.bfloat16), requires_grad=False)
    param.data.copy_(views["w"].narrow(0, 4, 3))
    assert torch.equal(param.data, w[4:7])
    with pytest.raises(IndexError):
        views["w"].narrow(0, 5, 3)


def test_files_unmap(stored, tmp_path):
    _, views = stored
    views["n"].materialize()
    assert shard_reads._MAPS
    shard_reads.close_maps()
    assert not shard_reads._MAPS
    assert torch.equal(views["n"].materialize(), stored[0]["n"])  # mapped again on demand
