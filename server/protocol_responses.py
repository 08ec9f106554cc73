"""OpenAI Responses API request bodies (pydantic, server-only): input items, flat function tools, text.format."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")  # clients (Codex, the Agents SDK) send fields we ignore


class InputMessage(_Lenient):
    """``{"role": ..., "content": str | parts}``, with or without ``"type": "message"`` (earlier output items too)."""

    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[dict[str, Any]]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(_Lenient):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Lenient):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[dict[str, Any]]
    id: str | None = None
    status: str | None = None


class ReasoningItem(_Lenient):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: str | None = None


InputItem = FunctionCallItem | FunctionCallOutputItem | ReasoningItem | InputMessage


class FunctionTool(_Lenient):
    """The Responses API's flat function tool (no ``function`` wrapper as in chat completions)."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ReasoningConfig(_Lenient):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: str | None = None


class TextFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Lenient):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(_Lenient):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    metadata: dict[str, Any] | None = None
    user: str | None = None
    # vLLM's extensions, as on the other OpenAI routes
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    ignore_eos: bool = False
    repetition_penalty: float | None = None
    chat_template_kwargs: dict[str, Any] | None = None
