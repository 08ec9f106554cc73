"""Anthropic routes: ``/v1/messages`` (streaming and not) and ``/v1/messages/count_tokens``."""
from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from armillary.errors import InvalidRequestError
from armillary.parsers.base import ParserPipeline
from armillary.server import anthropic_render as render
from armillary.server.async_engine import RequestStream
from armillary.server.errors import anthropic_error_body, bad_request
from armillary.server.openai_api import CLIENT_CLOSED, collect
from armillary.server.prompts import (
    RenderedPrompt,
    ToolChoice,
    anthropic_messages,
    anthropic_tool_choice,
    anthropic_tools,
    render_chat,
    template_kwargs,
    thinking_flag,
)
from armillary.server.protocol_anthropic import CountTokensRequest, MessagesRequest
from armillary.server.sampling import RequestedStructure, build_sampling_params, compile_structure
from armillary.server.state import ServerState, engine_error, new_id, parse_body, read_json
from armillary.server.streaming import EventStreamResponse, OutputDeltas, sse_event, until_disconnect
from armillary.server.thinking import ReplyThinking, reply_thinking
from armillary.structured.spec import StructuredSpec


def _requested_structure(body: CountTokensRequest) -> RequestedStructure | None:
    """JSON output per ``output_config.format`` (or the beta's ``output_format``)."""
    config_format = body.output_config.format if body.output_config is not None else None
    if config_format is not None and body.output_format is not None:
        raise bad_request("give output_config.format or output_format, not both", param="output_format")
    fmt, param = (config_format, "output_config.format") if config_format is not None \
        else (body.output_format, "output_format")
    if fmt is None:
        return None
    try:
        return StructuredSpec.json_schema(fmt.schema_, f"{param}.schema"), f"{param}.schema"
    except InvalidRequestError as exc:
        raise bad_request(str(exc), param=f"{param}.schema") from exc


async def _render(state: ServerState, body: CountTokensRequest, max_model_len: int | None
                  ) -> tuple[RenderedPrompt, list[dict] | None, ToolChoice, ReplyThinking]:
    """The prompt for a Messages body, its tools in OpenAI form, what its tool_choice means, and its
    thinking (``thinking.budget_tokens`` or the effort; the mode's sampling defaults).

    ``max_model_len``: refuse a prompt that does not fit (None: count only)."""
    tools = anthropic_tools(body.tools)
    choice = anthropic_tool_choice(body.tool_choice, tools)
    if body.thinking is not None:
        enable_thinking = thinking_flag(body.thinking)
    else:  # Anthropic's thinking is opt-in, unless the operator made it the server's default
        enable_thinking = bool(state.default_template_kwargs.get("enable_thinking", False))
    output = body.output_config
    kwargs = template_kwargs(state.default_template_kwargs, None, enable_thinking=enable_thinking,
                             reasoning_effort=output.effort if output is not None else None)
    messages = anthropic_messages(body.system, body.messages)
    # rendering and tokenizing a long conversation takes a while: never on the event loop
    prompt = await run_in_threadpool(render_chat, state.tokenizer, messages, tools if choice.parse_tools else None,
                                     kwargs, True, max_model_len)
    budget = body.thinking.budget_tokens if body.thinking is not None and enable_thinking else None
    thinking = reply_thinking(state, prompt.text, tools if choice.parse_tools else None, kwargs,
                              output.effort if output is not None else None, budget)
    return prompt, tools, choice, thinking


def build_router(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> JSONResponse:
        body = parse_body(CountTokensRequest, await read_json(request, state.max_body_bytes))
        state.model_name(body.model)
        state.require_ready()
        prompt, _, _, _ = await _render(state, body, None)
        return JSONResponse({"input_tokens": len(prompt.token_ids)})

    @router.post("/v1/messages")
    async def messages(request: Request) -> Response:
        body = parse_body(MessagesRequest, await read_json(request, state.max_body_bytes))
        model = state.model_name(body.model)
        state.require_ready()
        state.limits.check_messages(body)
        prompt, tools, choice, thinking = await _render(state, body, state.max_model_len)
        # the tool parser and grammar of the reply: forced or strict tool calls, or a JSON output format
        plan = state.parsers.plan(prompt.text, tools, choice, _requested_structure(body),
                                  state.enable_auto_tool_choice)
        structure = plan.structure
        await compile_structure(state.engine.engine, structure)
        stop_sequences = list(body.stop_sequences or [])
        params = build_sampling_params(thinking.sampling_defaults, state.parsers.keep_special_tokens,
                                       max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p,
                                       top_k=body.top_k, stop=stop_sequences,
                                       structured=structure[0] if structure is not None else None,
                                       **thinking.fields())
        pipeline = state.parsers.pipeline(prompt.text, tools, plan)
        message_id = new_id("msg_")
        stream = await state.submit(message_id, prompt.token_ids, params)
        if body.stream:
            return EventStreamResponse(_message_events(state, stream, message_id, model, pipeline,
                                                       len(prompt.token_ids), stop_sequences))
        final = await until_disconnect(request, collect(state, stream))
        if final is None:
            return Response(status_code=CLIENT_CLOSED)
        out = final.outputs[0]
        parsed = pipeline.parse_complete(out.text)
        stop, stop_sequence = render.stop_reason(out.finish_reason, out.stop_reason, stop_sequences,
                                                 bool(parsed.tool_calls))
        return JSONResponse(render.message_json(message_id, model, render.content_blocks(parsed), stop,
                                                stop_sequence, len(final.prompt_token_ids), len(out.token_ids),
                                                final.num_cached_tokens))

    return router


async def _message_events(state: ServerState, stream: RequestStream, message_id: str, model: str,
                          pipeline: ParserPipeline, input_tokens: int,
                          stop_sequences: list[str]) -> AsyncIterator[str]:
    renderer = render.BlockStreamRenderer()
    deltas = OutputDeltas()
    try:
        yield sse_event(*render.message_start(message_id, model, input_tokens))
        yield sse_event(*render.PING)
        async for out in stream:
            for d in deltas.update(out):
                events = pipeline.feed(d.text) if d.text else []
                if d.finished_now:
                    events += pipeline.finish()
                for name, payload in renderer.render(events, final=d.finished_now):
                    yield sse_event(name, payload)
                if d.finished_now:
                    stop, stop_sequence = render.stop_reason(d.finish_reason, d.stop_reason, stop_sequences,
                                                             renderer.has_tool_use)
                    for name, payload in render.message_end(stop, stop_sequence, len(out.outputs[0].token_ids),
                                                            input_tokens, out.num_cached_tokens):
                        yield sse_event(name, payload)
    except Exception as exc:
        yield sse_event("error", anthropic_error_body(engine_error(exc)))
    finally:
        if not stream.done:
            state.engine.abort(stream.request_id)

