"""Fixtures shared by the core tests: the tiny Qwen-style tokenizer, ours and transformers' view of it."""
from __future__ import annotations

import pytest

from armillary.tokenizer import Tokenizer
from tests.fixtures.tiny_tokenizer import make_qwen_tokenizer


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen_tok")
    make_qwen_tokenizer(directory, vocab_size=512)
    return directory


@pytest.fixture(scope="session")
def tok(tok_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(tok_dir)


@pytest.fixture(scope="session")
def hf(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_dir)
