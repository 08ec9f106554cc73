"""Speculation under grammars: drafts go through each sequence's matcher (a draft the grammar
forbids ends the accepted prefix) and the matcher rolls back with rejected tokens. A json_schema
and forced tool calls (qwen3_coder) with speculation on validate every time and equal the output
with it off, drafted by the MTP head and by an oracle whose drafts are partly right."""
from __future__ import annotations

import json

import jsonschema
import pytest

from armillary import LLM, SamplingParams
from armillary.parsers.base import ParserPipeline
from armillary.server.openai_render import chat_message
from armillary.structured.spec import StructuredSpec, ToolCallConstraint
from armillary.parsers.qwen3_coder import Qwen3CoderToolParser
from armillary_qwen_gdn_moe.parsers.reasoning import Qwen3ReasoningParser
from plugins.qwen_gdn_moe.tests.harness import qwen_registry
from plugins.qwen_gdn_moe.tests.hf_models import CASES_BY_NAME, VOCAB
from plugins.qwen_gdn_moe.tests.mtp_checkpoint import save_with_mtp
from tests.fixtures.oracle_drafts import OracleProposer, oracle_reference
from tests.fixtures.tiny_tokenizer import make_qwen_tokenizer

SCHEMA = {"type": "object", "properties": {
    "color": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "ok": {"type": "boolean"}}, "required": ["color", "n", "ok"]}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add numbers", "parameters": {
    "type": "object", "properties": {
        "xs": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 3},
        "label": {"type": "string", "enum": ["sum", "total"]}},
    "required": ["xs", "label"]}}}]
QUESTIONS = ["Add two and three.", "What is 4 plus 5?", "Sum these: 1, 2", "Please add 7 and 8 now."]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = save_with_mtp(CASES_BY_NAME["next_full_last"], tmp_path_factory.mktemp("spec_structured"))
    make_qwen_tokenizer(path, vocab_size=VOCAB)
    return path


def _llm(model_dir, **kw) -> LLM:
    return LLM(str(model_dir), registry=qwen_registry(), dtype="float32", max_model_len=1024, max_num_seqs=8, **kw)


def _prompts(llm: LLM) -> list[list[int]]:
    tok = llm.get_tokenizer()
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], enable_thinking=False))
            for q in QUESTIONS]


def _generate(llm: LLM, prompts: list[list[int]], spec: StructuredSpec, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, structured=spec)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].finish_reason for o in outs] == ["stop"] * len(prompts)
    assert len(llm.engine.structured) == 0  # every matcher freed
    return [list(o.outputs[0].token_ids) for o in outs]


def _check(model_dir, prompts, spec, max_tokens, validate) -> None:
    base_llm = _llm(model_dir)
    base = _generate(base_llm, prompts, spec, max_tokens)
    for oracle in (False, True):
        spec_llm = _llm(model_dir, speculative=True, num_drafts=2)
        runner = spec_llm.engine.runner
        if oracle:
            runner.proposer = OracleProposer(runner.proposer, oracle_reference(prompts, base), VOCAB)
        got = _generate(spec_llm, prompts, spec, max_tokens)
        assert got == base
        tok = spec_llm.get_tokenizer()
        for ids in got:
            validate(tok.decode(ids))
        if oracle:
            assert spec_llm.engine.stats()["num_accepted_tokens"] > 0


def test_json_schema_with_speculation_equals_without(model_dir):
    llm = _llm(model_dir)
    spec = StructuredSpec("json_schema", json.dumps(SCHEMA, separators=(",", ":")))
    _check(model_dir, _prompts(llm), spec, 200, lambda text: jsonschema.validate(json.loads(text), SCHEMA))


def test_forced_tool_call_with_speculation_equals_without(model_dir):
    llm = _llm(model_dir)
    spec = Qwen3CoderToolParser.tool_call_grammar(TOOLS, ToolCallConstraint(True, ("add",), frozenset({"add"}),
                                                                            parallel=False))

    def validate(text: str) -> None:
        parsed = ParserPipeline(Qwen3ReasoningParser(thinking_open=False), Qwen3CoderToolParser(TOOLS)
                                ).parse_complete(text)
        calls = chat_message(parsed)["tool_calls"]
        assert calls and all(c["function"]["name"] == "add" for c in calls), text
        for call in calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]), TOOLS[0]["function"]["parameters"])

    _check(model_dir, _prompts(llm), spec, 300, validate)
