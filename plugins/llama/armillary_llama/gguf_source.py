"""``armillary serve model.gguf``: a llama GGUF file as an armillary ``ModelSource``.

Opening the file parses its header and checks every tensor (known name, supported type, bytes
inside the file) before any model is built, so a bad file fails in a second with a message that
names the tensor. ``iter_weights`` then dequantizes one tensor at a time.
"""
from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from armillary.errors import ModelNotFoundError
from armillary.hf_config import HFConfig
from armillary.model_source import ModelSource
from armillary.tokenizer import Tokenizer
from armillary_llama.gguf_config import ARCHITECTURES, generation_defaults, llama_config
from armillary_llama.gguf_file import GGUFFile, peek_architecture, read_gguf
from armillary_llama.gguf_tensors import check_supported, dequantize, hf_name, unpermute_rotary_rows
from armillary_llama.gguf_tokenizer import gguf_tokenizer


class GGUFSource(ModelSource):
    """One llama-architecture ``.gguf`` file."""

    @classmethod
    def matches(cls, model: str) -> bool:
        """A ``.gguf`` file holding a llama model, or one too damaged to say (so that we report the damage)."""
        path = Path(model).expanduser()
        if path.suffix.lower() != ".gguf" or not path.is_file():
            return False
        arch = peek_architecture(path)
        return arch is None or arch in ARCHITECTURES

    def __init__(self, model: str, revision: str | None = None) -> None:
        path = Path(model).expanduser()
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file {str(path.absolute())!r} does not exist")
        self.path = path.resolve()
        self.gguf: GGUFFile = read_gguf(self.path)
        self._config = llama_config(self.gguf)
        self._names = {name: hf_name(name) for name in self.gguf.tensors}  # raises on tensors we do not know
        for name, target in self._names.items():
            if target is not None:
                check_supported(self.gguf.tensors[name], str(self.path))

    def hf_config(self) -> HFConfig:
        return HFConfig(self._config)

    def iter_weights(self, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """``(Hugging Face name, float32 tensor)`` per weight, Q/K rows back in Hugging Face order."""
        heads = {"q_proj": self._config["num_attention_heads"], "k_proj": self._config["num_key_value_heads"]}
        weights = [(name, target) for name, target in self._names.items() if target is not None]
        show = progress and sys.stderr.isatty()
        for name, target in tqdm(weights, desc="Dequantizing GGUF", unit="tensor", disable=not show):
            tensor = dequantize(self.gguf, self.gguf.tensors[name])
            projection = target.rsplit(".", 2)[-2]
            if projection in heads:
                tensor = unpermute_rotary_rows(tensor, heads[projection])
            yield target, tensor

    def tokenizer(self) -> Tokenizer | None:
        return gguf_tokenizer(self.gguf)

    def generation_defaults(self) -> dict[str, Any]:
        return generation_defaults(self.gguf)
