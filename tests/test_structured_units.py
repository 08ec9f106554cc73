"""The pieces of structured output on their own: specs, schema rewriting, masks, UTF-8, tokenizer info, matchers."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import xgrammar as xgr

from armillary.errors import InvalidRequestError
from armillary.sampling_params import SamplingParams
from armillary.sequence import Sequence
from armillary.structured.bitmask import apply_token_bitmask, apply_token_bitmask_reference, unpack_bitmask
from armillary.structured.compiler import GrammarCompiler, xgrammar_message
from armillary.structured.json_schema import prepare_json_schema
from armillary.structured.outputs import StructuredOutputs
from armillary.structured.spec import StructuredSpec
from armillary.structured.tokenizer_info import build_tokenizer_info, vocab_metadata
from armillary.structured.utf8 import Utf8Guard, invalid_utf8_tokens, pending_lead
from armillary.tokenizer import Tokenizer
from tests.fixtures.tiny_tokenizer import make_qwen_tokenizer

VOCAB = 300
EOS = (293, 291)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("units_tokenizer")
    make_qwen_tokenizer(path, vocab_size=VOCAB)
    return Tokenizer.from_pretrained(path)


# ---- specs

def test_specs_check_their_input_and_keep_property_order():
    schema = {"type": "object", "properties": {"z": {}, "a": {}}}
    assert list(json.loads(StructuredSpec.json_schema(schema).source)["properties"]) == ["z", "a"]
    assert StructuredSpec.json_schema(json.dumps(schema)) == StructuredSpec.json_schema(schema)
    for make, value in [(StructuredSpec.json_schema, "{not json"), (StructuredSpec.json_schema, [1]),
                        (StructuredSpec.regex, ""), (StructuredSpec.choice, []), (StructuredSpec.choice, ["a", 1]),
                        (StructuredSpec.grammar, "  "), (StructuredSpec.structural_tag, {"no": "format"})]:
        with pytest.raises(InvalidRequestError):
            make(value)
    spec = StructuredSpec.regex("a+")
    assert spec.after_reasoning("</think>").reasoning_end == "</think>" and spec.after_reasoning(None) == spec


def test_string_length_bounds_become_patterns_everywhere():
    schema = {"type": "object", "properties": {
        "s": {"type": "string", "minLength": 1, "maxLength": 3},
        "t": {"type": ["string", "null"], "maxLength": 2},
        "e": {"type": "string", "enum": ["a"], "maxLength": 1},
        "l": {"type": "array", "items": {"type": "string", "minLength": 2}}},
        "$defs": {"d": {"anyOf": [{"type": "string", "maxLength": 4}]}}}
    prepared = prepare_json_schema(schema)
    props = prepared["properties"]
    assert props["s"] == {"type": "string", "pattern": "^[\\s\\S]{1,3}$"}
    assert props["t"]["pattern"] == "^[\\s\\S]{0,2}$" and "maxLength" not in props["t"]
    assert props["e"] == schema["properties"]["e"]  # an enum already fixes the values
    assert props["l"]["items"]["pattern"] == "^[\\s\\S]{2,}$"
    assert prepared["$defs"]["d"]["anyOf"][0]["pattern"] == "^[\\s\\S]{0,4}$"
    assert schema["properties"]["s"]["maxLength"] == 3  # the request's schema is left alone
    for bad in [{"type": "string", "pattern": "a", "maxLength": 2},
                {"type": "string", "format": "date", "minLength": 1},
                {"type": "string", "minLength": 3, "maxLength": 2}, {"type": "string", "maxLength": -1}]:
        with pytest.raises(InvalidRequestError):
            prepare_json_schema(bad)


# ---- masks

def test_bitmask_application_matches_a_plain_loop():
    gen = torch.Generator().manual_seed(0)
    vocab = 70  # not a multiple of 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (4, 3), dtype=torch.int32, generator=gen)
    logits = torch.randn(4, vocab, generator=gen)
    for rows in ([3, 1], [0, 1, 2, 3]):
        fast, reference = logits.clone(), logits.clone()
        apply_token_bitmask(fast, bitmask, rows)  # the CPU path
        apply_token_bitmask_reference(reference, bitmask, rows)
        for b in range(4):
            for v in range(vocab):
                allowed = b not in rows or (int(bitmask[b, v // 32]) >> (v % 32)) & 1
                assert fast[b, v].item() == (logits[b, v].item() if allowed else float("-inf"))
        assert torch.equal(fast, reference)
    wide = unpack_bitmask(bitmask[:1, :1], 40)  # past the mask's 32 tokens: forbidden
    assert wide.shape == (1, 40) and not wide[0, 32:].any()
    with pytest.raises(ValueError):
        apply_token_bitmask(torch.zeros(1, 100), bitmask[:1], [0])


def test_utf8_guard_blocks_wrong_second_bytes():
    assert pending_lead(b"ab\xe0") == 0xE0 and pending_lead(b"\xe0\xa0") is None and pending_lead(b"\xc3") is None
    vocab = [b"a", b"\xe0", b"\x80", b"\xa0", b"\xbf", b"\x9f", b"", b"\xc0", b"\xed\xa0\x80", b"\xf4\x90"]
    assert invalid_utf8_tokens(vocab) == [7, 8, 9]
    guard = Utf8Guard(vocab, len(vocab))
    row = torch.full((1,), -1, dtype=torch.int32)  # every token allowed
    guard.restrict(row, [0, 1])  # output ends in E0: its second byte must be A0-BF
    allowed = unpack_bitmask(row[None], len(vocab))[0].tolist()
    assert allowed == [True, True, False, True, True, False, True, True, True, True]
    row = torch.full((1,), -1, dtype=torch.int32)
    guard.restrict(row, [1, 3])  # E0 A0: complete lead, nothing to narrow
    assert row.item() == -1


# ---- tokenizer info

def test_tokenizer_info_from_the_tokenizers_backend(tokenizer):
    assert vocab_metadata(tokenizer.backend) == (xgr.VocabType.BYTE_LEVEL, False)
    padded = VOCAB + 20  # an lm_head wider than the tokenizer
    info = build_tokenizer_info(tokenizer, padded, EOS)
    assert info.vocab_size == padded and sorted(info.stop_token_ids) == sorted(EOS)
    special = set(tokenizer.all_special_ids)
    decoded = info.decoded_vocab
    for token_id in range(VOCAB):
        text = tokenizer.decode([token_id], skip_special_tokens=False).encode()
        if token_id in special:
            assert decoded[token_id] == b""  # no text: no grammar can pick it
        elif b"\xef\xbf\xbd" not in text:  # single bytes of multi-byte characters decode to U+FFFD alone
            assert decoded[token_id] == text, token_id
    assert decoded[tokenizer.token_to_id("<tool_call>")] == b"<tool_call>"
    assert all(d == b"" for d in decoded[VOCAB:])
    assert all(decoded[i] == b"" for i in invalid_utf8_tokens([tokenizer.decode([i]).encode("utf-8", "surrogatepass")
                                                               for i in range(VOCAB)]) if i not in special)


# ---- compiler and matchers

def test_compiler_caches_names_errors_and_is_thread_safe(tokenizer):
    compiler = GrammarCompiler(tokenizer, VOCAB, EOS, max_cached=2)
    specs = [StructuredSpec.regex(f"[a-z]{{{i}}}") for i in range(1, 4)]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(compiler.compile, specs * 3))
    assert all(r is not None for r in results)
    first = compiler.compile(specs[2])
    assert compiler.compile(specs[2]) is first and len(compiler._cache) == 2
    with pytest.raises(InvalidRequestError) as info:
        compiler.compile(StructuredSpec.json_schema({"enum": []}))
    assert str(info.value) == "invalid json schema: enum array must not be empty"
    with pytest.raises(InvalidRequestError, match="no output can satisfy it"):
        compiler.compile(StructuredSpec.grammar("root ::= [^\\0-\\U0010ffff]"))
    assert xgrammar_message(RuntimeError("[01:02:03] /x/y.cc:12: Check failed: (a) is false: bad thing\nmore")) \
        == "bad thing"


def _mask(outputs: StructuredOutputs, seq: Sequence) -> torch.Tensor:
    return outputs.fill([seq]).bitmask.clone()


def test_matchers_follow_their_sequence_back_and_forth(tokenizer):
    outputs = StructuredOutputs(tokenizer, VOCAB, EOS)
    spec = StructuredSpec.json_schema({"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]})
    compiled = outputs.compile(spec)
    tokens = tokenizer.encode('{"k": 12')
    seq = Sequence("r", 0, [5, 6], SamplingParams())
    outputs.attach(seq, compiled)
    masks = [_mask(outputs, seq)]
    for token in tokens:
        seq.token_ids.append(token)
        assert outputs.advance(seq, token) is False
        masks.append(_mask(outputs, seq))
    del seq.token_ids[-3:]  # three tokens rejected (a speculative step): the matcher rolls back
    assert torch.equal(_mask(outputs, seq), masks[-4])
    seq.token_ids.extend(tokens[-3:])  # tokens that arrived without advance (a recompute) are replayed
    assert torch.equal(_mask(outputs, seq), masks[-1])
    outputs.rollback(seq, 2)
    del seq.token_ids[-2:]
    assert torch.equal(_mask(outputs, seq), masks[-3])
    for token in tokenizer.encode("12}"):
        seq.token_ids.append(token)
        outputs.advance(seq, token)
    seq.token_ids.append(EOS[0])
    assert outputs.advance(seq, EOS[0]) is True  # the grammar took its stop token
    outputs.release(seq)
    assert len(outputs) == 0 and outputs.fill([seq]) is None
