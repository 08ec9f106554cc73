"""Chat-template rendering against transformers' ``apply_chat_template`` on the same directory."""
from __future__ import annotations

import copy
import json

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from armillary.chat_template import ChatTemplateError, render_chat_template
from armillary.errors import InvalidRequestError
from armillary.tokenizer import Tokenizer

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city (°C), e.g. 東京",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"},
        "units": {"type": "array", "items": {"type": "string"}}, "verbose": {"type": "boolean"}},
        "required": ["city"]}}}
SEARCH_TOOL = {"type": "function", "function": {
    "name": "search", "description": "Search the web",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}

PLAIN = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Tell me a joke about 猫 😺"},
]
WITH_SYSTEM = [{"role": "system", "content": "You are terse."}, *PLAIN]
TOOL_LOOP = [
    {"role": "system", "content": "Use tools when useful."},
    {"role": "user", "content": "Weather in Paris and Tokyo, and search news?"},
    {"role": "assistant", "content": "Let me check.", "reasoning_content": "Need two calls.\n",
     "tool_calls": [
         {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {
             "city": "Paris", "days": 3, "units": ["C", "F"], "verbose": True, "extra": {"a": "é"}}}},
         {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "東京"}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'},
    {"role": "tool", "tool_call_id": "c2", "content": '{"temp": 18}'},
    {"role": "assistant", "content": None, "reasoning_content": "Now search.",
     "tool_calls": [{"id": "c3", "type": "function", "function": {"name": "search",
                                                                   "arguments": {"query": "news"}}}]},
    {"role": "tool", "tool_call_id": "c3", "content": "Nothing new."},
]
REASONING_HISTORY = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "Simple arithmetic."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n6"},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": "You're welcome.", "thinking": "Be polite."},
]
CONTENT_PARTS = [
    {"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "nice."}]},
    {"role": "user", "content": [{"type": "text", "text": "Hello"}]},
]

CASES = {
    "plain": (PLAIN, None, {}),
    "system": (WITH_SYSTEM, None, {}),
    "tools_no_calls": (WITH_SYSTEM, [WEATHER_TOOL, SEARCH_TOOL], {}),
    "tool_loop": (TOOL_LOOP, [WEATHER_TOOL, SEARCH_TOOL], {}),
    "tool_loop_thinking_off": (TOOL_LOOP, [WEATHER_TOOL], {"enable_thinking": False}),
    "thinking_on": (WITH_SYSTEM, None, {"enable_thinking": True}),
    "thinking_off": (WITH_SYSTEM, None, {"enable_thinking": False}),
    "reasoning_history": (REASONING_HISTORY, None, {}),
    "content_parts": (CONTENT_PARTS, None, {}),
}


@pytest.mark.parametrize("generation_prompt", [True, False])
@pytest.mark.parametrize("case", sorted(CASES))
def test_render_matches_transformers(tok, hf, case, generation_prompt):
    messages, tools, kwargs = CASES[case]
    before = copy.deepcopy(messages)
    ours = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt, **kwargs)
    theirs = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt,
                                    tokenize=False, **kwargs)
    assert ours == theirs
    assert messages == before  # the caller's messages are not modified


@pytest.mark.parametrize("case", sorted(CASES))
def test_prompt_ids_match_transformers(tok, hf, case):
    messages, tools, kwargs = CASES[case]
    prompt = tok.apply_chat_template(messages, tools=tools, **kwargs)
    theirs = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                    return_dict=False, **kwargs)
    assert tok.encode(prompt) == list(theirs)


def test_fixture_template_shapes(tok):
    """The fixture template writes what Qwen3.5 writes, so server and parser tests can rely on it."""
    on = tok.apply_chat_template(WITH_SYSTEM)
    off = tok.apply_chat_template(WITH_SYSTEM, enable_thinking=False)
    assert on.endswith("<|im_start|>assistant\n<think>\n")
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    loop = tok.apply_chat_template(TOOL_LOOP, tools=[WEATHER_TOOL])
    assert loop.startswith("<|im_start|>system\nUse tools when useful.\n\n# Tools\n")
    assert '"description": "Current weather in a city (°C), e.g. 東京"' in loop
    assert ("Let me check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n<parameter=units>\n[\"C\", \"F\"]\n</parameter>\n") in loop
    assert ("<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response>\n<tool_response>\n"
            "{\"temp\": 18}\n</tool_response><|im_end|>\n") in loop
    assert "<think>\nNeed two calls.\n</think>\n\nLet me check." in loop
    history = tok.apply_chat_template(REASONING_HISTORY, add_generation_prompt=False)
    assert "Simple arithmetic" not in history and "Add them" not in history  # before the last user turn
    assert "<think>\nBe polite.\n</think>\n\nYou're welcome." in history


def test_json_string_arguments_render_like_a_mapping(tok, hf):
    as_string = copy.deepcopy(TOOL_LOOP)
    for message in as_string:
        for call in message.get("tool_calls") or []:
            call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
    ours = tok.apply_chat_template(as_string, tools=[WEATHER_TOOL])
    assert ours == hf.apply_chat_template(TOOL_LOOP, tools=[WEATHER_TOOL], add_generation_prompt=True,
                                          tokenize=False)
    assert "<parameter=city>\nParis\n</parameter>" in ours


def test_template_exception_is_a_request_error(tok):
    with pytest.raises(InvalidRequestError, match="system message must be the first"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])
    with pytest.raises(InvalidRequestError, match="empty conversation"):
        tok.apply_chat_template([])
    with pytest.raises(InvalidRequestError, match="messages\\[0\\]"):
        tok.apply_chat_template(["just a string"])


# --- the environment itself, against transformers' renderer -------------------------------------

ENV_TEMPLATE = """{% set ns = namespace(count=0) %}
{% for m in messages %}
  {% if m.role == 'skip' %}{% continue %}{% endif %}
  {% set ns.count = ns.count + 1 %}
  {{ m | tojson }}|{{ m | tojson(indent=2) }}|{{ m | tojson(sort_keys=true, separators=(',', ':')) }}
  {% if ns.count == 2 %}{% break %}{% endif %}
{% endfor %}
{{ dict(a=1, b=[1, 2]) | tojson }} {{ dict.fromkeys(['x', 'y'], 0) | tojson }}
{{ tools | tojson }} {{ bos_token }}/{{ eos_token }} {{ flag }} {{ add_generation_prompt }} {{ documents }}
{{ strftime_now('%Y') | length }}
"""


def test_environment_matches_transformers():
    messages = [{"role": "user", "content": "héllo <b>&</b> 😀", "n": None},
                {"role": "skip", "content": "x"},
                {"role": "assistant", "content": "line\nbreak", "reasoning": "why"},
                {"role": "user", "content": "never reached"}]
    tools = [SEARCH_TOOL]
    special = {"bos_token": "<s>", "eos_token": "</s>"}
    ours = render_chat_template(ENV_TEMPLATE, messages, tools=tools, add_generation_prompt=False,
                                special_tokens=special, flag=True)
    normalized = [{k: v for k, v in m.items() if v is not None} for m in messages]
    theirs, _ = render_jinja_template([normalized], tools=tools, chat_template=ENV_TEMPLATE,
                                      add_generation_prompt=False, **special, flag=True)
    assert ours == theirs[0]
    assert "héllo <b>&</b> 😀" in ours  # tojson keeps non-ASCII and HTML characters as they are


def test_kwargs_override_special_tokens():
    out = render_chat_template("{{ eos_token }}", [{"role": "user", "content": "x"}],
                               special_tokens={"eos_token": "</s>"}, eos_token="<END>")
    assert out == "<END>"


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__ }}",
    "{% set ns = namespace() %}{% set ns._hidden = 1 %}",
    "{{ messages.append(1) }}",
    "{{ raise_exception('nope') }}",
])
def test_sandbox_refuses_escapes(template):
    with pytest.raises(InvalidRequestError):
        render_chat_template(template, [{"role": "user", "content": "x"}])


def test_syntax_error_is_a_template_error():
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render_chat_template("{% for %}", [{"role": "user", "content": "x"}])


# --- where the template comes from --------------------------------------------------------------


def _copy_tokenizer(src, dst, with_jinja: bool):
    dst.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (dst / name).write_bytes((src / name).read_bytes())
    if with_jinja:
        (dst / "chat_template.jinja").write_bytes((src / "chat_template.jinja").read_bytes())


def test_template_sources_and_priority(tok_dir, tmp_path):
    msgs = [{"role": "user", "content": "x"}]
    # in tokenizer_config.json
    _copy_tokenizer(tok_dir, tmp_path / "cfg", with_jinja=False)
    config = json.loads((tmp_path / "cfg" / "tokenizer_config.json").read_text())
    config["chat_template"] = "CFG{{ messages[0].content }}"
    (tmp_path / "cfg" / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_pretrained(tmp_path / "cfg").apply_chat_template(msgs) == "CFGx"
    # chat_template.jinja wins over the config entry
    (tmp_path / "cfg" / "chat_template.jinja").write_text("JINJA")
    assert Tokenizer.from_pretrained(tmp_path / "cfg").apply_chat_template(msgs) == "JINJA"
    # named templates: tool_use picked when tools are given
    _copy_tokenizer(tok_dir, tmp_path / "named", with_jinja=False)
    config["chat_template"] = [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]
    (tmp_path / "named" / "tokenizer_config.json").write_text(json.dumps(config))
    named = Tokenizer.from_pretrained(tmp_path / "named")
    assert named.apply_chat_template(msgs) == "D"
    assert named.apply_chat_template(msgs, tools=[SEARCH_TOOL]) == "T"
    assert named.apply_chat_template(msgs, chat_template="tool_use") == "T"
    assert named.apply_chat_template(msgs, chat_template="S{{ 1 }}") == "S1"
    # processor-style chat_template.json as the last resort
    _copy_tokenizer(tok_dir, tmp_path / "legacy", with_jinja=False)
    (tmp_path / "legacy" / "chat_template.json").write_text(json.dumps({"chat_template": "LEGACY"}))
    assert Tokenizer.from_pretrained(tmp_path / "legacy").apply_chat_template(msgs) == "LEGACY"
    # none at all
    _copy_tokenizer(tok_dir, tmp_path / "none", with_jinja=False)
    with pytest.raises(InvalidRequestError, match="no chat template"):
        Tokenizer.from_pretrained(tmp_path / "none").apply_chat_template(msgs)
