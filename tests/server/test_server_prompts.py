"""Request conversion: both protocols' conversations to template messages, tool choices, sampling, error shapes."""
from __future__ import annotations

import pytest

from armillary.errors import InvalidRequestError
from armillary.server.errors import APIError, anthropic_error_body, openai_error_body
from armillary.server.prompts import (
    anthropic_messages,
    anthropic_tools,
    check_anthropic_tool_choice,
    check_openai_tool_choice,
    openai_messages,
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
    assert check_openai_tool_choice(None, True) is True
    assert check_openai_tool_choice("auto", True) is True
    assert check_openai_tool_choice("none", True) is False
    assert check_openai_tool_choice(None, False) is False
    for forced in ("required", {"type": "function", "function": {"name": "f"}}):
        with pytest.raises(APIError, match="not supported yet"):
            check_openai_tool_choice(forced, True)
    with pytest.raises(APIError):
        check_openai_tool_choice("sometimes", True)
    body = MessagesRequest.model_validate({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
                                           "tool_choice": {"type": "any"}})
    with pytest.raises(APIError, match="not supported yet"):
        check_anthropic_tool_choice(body.tool_choice, True)


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
