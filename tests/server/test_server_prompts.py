"""Request conversion: both protocols' conversations to template messages, tool choices, sampling, error shapes."""
from __future__ import annotations

import pytest

from armillary.errors import InvalidRequestError
from armillary.server.errors import APIError, anthropic_error_body, openai_error_body
from armillary.server.prompts import (
    anthropic_messages,
    anthropic_tool_choice,
    anthropic_tools,
    openai_messages,
    openai_tool_choice,
    template_kwargs,
    thinking_flag,
)
from armillary.server.protocol_anthropic import MessagesRequest
from armillary.server.protocol_openai import ChatCompletionRequest
from armillary.server.sampling import build_sampling_params
from armillary.server.state import parse_body


def test_openai_messages_map_roles_parts_tool_calls_and_reasoning():
    body = ChatCompletionRequest.model_validate({"messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "weather"}, {"type": "text", "text": "in Paris?"}]},
        {"role": "assistant", "content": None, "reasoning_content": "call it",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]})
    assert openai_messages(body.messages) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather\nin Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "call it",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]


@pytest.mark.parametrize("message, fragment", [
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "not supported"),
    ({"role": "user"}, "required"),
    ({"role": "tool", "content": "x"}, "tool_call_id"),
])
def test_openai_messages_refuse_what_cannot_be_rendered(message, fragment):
    body = ChatCompletionRequest.model_validate({"messages": [message]})
    with pytest.raises(APIError) as info:
        openai_messages(body.messages)
    assert info.value.status == 400 and fragment in info.value.message


def test_anthropic_messages_map_system_tool_use_tool_result_and_thinking():
    body = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 5,
        "system": [{"type": "text", "text": "You help."}, {"type": "text", "text": "Briefly."}],
        "messages": [
            {"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "need the tool", "signature": "s"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                {"type": "text", "text": "thanks"}]},
        ]})
    assert anthropic_messages(body.system, body.messages) == [
        {"role": "system", "content": "You help.\nBriefly."},
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "need the tool",
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "user", "content": "thanks"},
    ]


def test_anthropic_blocks_in_the_wrong_role_or_unsupported_are_400():
    wrong = MessagesRequest.model_validate({"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]})
    with pytest.raises(APIError, match="assistant"):
        anthropic_messages(None, wrong.messages)
    image = MessagesRequest.model_validate({"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": ""}}]}]})
    with pytest.raises(APIError, match="not supported"):
        anthropic_messages(None, image.messages)


def test_anthropic_tools_become_openai_functions_and_server_tools_are_refused():
    body = MessagesRequest.model_validate({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
                                           "tools": [{"name": "f", "description": "d",
                                                      "input_schema": {"type": "object"}}]})
    assert anthropic_tools(body.tools) == [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object"}, "description": "d"}}]
    server_tool = MessagesRequest.model_validate({"model": "m", "max_tokens": 5,
                                                  "messages": [{"role": "user", "content": "x"}],
                                                  "tools": [{"name": "web_search", "type": "web_search_20250305"}]})
    with pytest.raises(APIError, match="not supported"):
        anthropic_tools(server_tool.tools)


def test_tool_choices():
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("f", "g")]
    assert openai_tool_choice(None, tools, None).parse_tools is True
    assert openai_tool_choice("auto", tools, None).constraint is None
    assert openai_tool_choice("none", tools, None).parse_tools is False
    assert openai_tool_choice(None, None, None).parse_tools is False
    required = openai_tool_choice("required", tools, False).constraint
    assert required.required and required.allowed == ("f", "g") and not required.parallel
    named = openai_tool_choice({"type": "function", "function": {"name": "g"}}, tools, None).constraint
    assert named.allowed == ("g",) and named.schema_checked == {"g"} and not named.parallel
    strict = [tools[0], {"type": "function", "function": {**tools[1]["function"], "strict": True}}]
    auto = openai_tool_choice("auto", strict, None).constraint
    assert not auto.required and auto.allowed == ("f", "g") and auto.schema_checked == {"g"} and auto.parallel
    for bad in ("sometimes", {"type": "function", "function": {"name": "h"}}):
        with pytest.raises(APIError):
            openai_tool_choice(bad, tools, None)
    with pytest.raises(APIError, match="needs tools"):
        openai_tool_choice("required", None, None)

    def anthropic_choice(choice: dict):
        body = MessagesRequest.model_validate({"model": "m", "max_tokens": 5, "tool_choice": choice,
                                               "messages": [{"role": "user", "content": "x"}]})
        return anthropic_tool_choice(body.tool_choice, tools)

    assert anthropic_choice({"type": "any"}).constraint.allowed == ("f", "g")
    assert not anthropic_choice({"type": "any", "disable_parallel_tool_use": True}).constraint.parallel
    assert anthropic_choice({"type": "tool", "name": "f"}).constraint.allowed == ("f",)
    assert anthropic_choice({"type": "none"}).parse_tools is False
    with pytest.raises(APIError, match="not among the tools"):
        anthropic_choice({"type": "tool", "name": "h"})


def test_thinking_and_template_kwargs():
    body = MessagesRequest.model_validate({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
                                           "thinking": {"type": "enabled", "budget_tokens": 1024}})
    assert thinking_flag(body.thinking) is True
    assert thinking_flag(None) is False
    merged = template_kwargs({"enable_thinking": False, "a": 1}, {"a": 2}, reasoning_effort="high", unset=None)
    assert merged == {"enable_thinking": False, "a": 2, "reasoning_effort": "high"}
    with pytest.raises(APIError, match="may not set"):
        template_kwargs({}, {"chat_template": "{{ evil }}"})


def test_sampling_params_take_generation_defaults_only_for_unset_fields():
    defaults = {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
    p = build_sampling_params(defaults, temperature=0.0, top_k=None, max_tokens=7, stop=None)
    assert (p.temperature, p.top_k, p.top_p, p.max_tokens, p.skip_special_tokens) == (0.0, 20, 0.95, 7, True)
    assert build_sampling_params({}, keep_special_tokens=True).skip_special_tokens is False
    with pytest.raises(InvalidRequestError, match="top_p"):
        build_sampling_params({}, top_p=1.5)


def test_validation_errors_name_the_field_in_both_shapes():
    with pytest.raises(APIError) as info:
        parse_body(MessagesRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}]})
    err = info.value
    assert err.status == 400 and err.param == "max_tokens" and "max_tokens" in err.message
    assert openai_error_body(err) == {"error": {"message": err.message, "type": "invalid_request_error",
                                                "param": "max_tokens", "code": None}}
    assert anthropic_error_body(err) == {"type": "error", "error": {"type": "invalid_request_error",
                                                                    "message": err.message}}
    with pytest.raises(APIError) as info:
        parse_body(ChatCompletionRequest, {"messages": [{"role": "wizard", "content": "x"}]})
    assert info.value.param == "messages.0.role"
    overloaded = APIError(503, "busy")
    assert anthropic_error_body(overloaded)["error"]["type"] == "overloaded_error"
    assert openai_error_body(APIError(401, "no"))["error"]["type"] == "authentication_error"
