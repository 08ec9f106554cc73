"""Responses API routes: ``POST /v1/responses`` (streaming and not), ``GET`` / ``DELETE`` by id, ``POST .../cancel``."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from armillary.outputs import RequestOutput
from armillary.parsers.base import ParserPipeline
from armillary.server import responses_render as render
from armillary.server.async_engine import RequestStream
from armillary.server.errors import APIError, bad_request
from armillary.server.openai_api import CLIENT_CLOSED, collect
from armillary.server.prompts import openai_tool_choice, render_chat, template_kwargs
from armillary.server.protocol_responses import ResponsesRequest
from armillary.server.responses_input import (
    chat_tool_choice,
    chat_tools,
    input_messages,
    output_messages,
    requested_format,
    thinking_kwargs,
)
from armillary.server.responses_store import ResponseStore
from armillary.server.sampling import build_sampling_params, compile_structure, output_budget
from armillary.server.state import ServerState, engine_error, new_id, parse_body, read_json
from armillary.server.streaming import EventStreamResponse, OutputDeltas, sse_event, until_disconnect
from armillary.server.thinking import reply_thinking

CANCELLED = "cancelled"  # the error code a cancelled response's stream reads, and the response's status


@dataclass(slots=True)
class _Turn:
    """One response being generated: what it stores and how its output is read."""

    head: render.ResponseHead
    history: list[dict]  # template messages before the output (without this turn's instructions)
    pipeline: ParserPipeline
    store: bool
    num_prompt_tokens: int


def _echo(body: ResponsesRequest) -> dict:
    """The request settings a response object repeats."""
    return {"instructions": body.instructions, "previous_response_id": body.previous_response_id,
            "tools": [t.model_dump(by_alias=True, exclude_none=True) for t in body.tools or []],
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "parallel_tool_calls": body.parallel_tool_calls is not False, "temperature": body.temperature,
            "top_p": body.top_p, "max_output_tokens": body.max_output_tokens, "store": body.store,
            "metadata": body.metadata or {}, "text": {"format": {"type": "text"}} if body.text is None
            else body.text.model_dump(by_alias=True, exclude_none=True),
            "reasoning": body.reasoning.model_dump(exclude_none=True) if body.reasoning else None,
            "user": body.user, "truncation": "disabled"}


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"no response with id {response_id!r} (never stored, store: false, deleted or expired)",
                    param="response_id", code="response_not_found")


def build_router(state: ServerState) -> APIRouter:
    router = APIRouter()
    store = state.responses
    in_flight: dict[str, RequestStream] = {}  # response id -> its engine stream, while generating

    @router.post("/v1/responses")
    async def create(request: Request) -> Response:
        body = parse_body(ResponsesRequest, await read_json(request, state.max_body_bytes))
        model = state.model_name(body.model)
        state.require_ready()
        state.limits.check_responses(body)
        history: list[dict] = []
        if body.previous_response_id is not None:
            previous = store.get(body.previous_response_id)
            if previous is None:
                raise _not_found(body.previous_response_id)
            if previous.response["status"] == "in_progress":
                raise bad_request(f"response {body.previous_response_id!r} is still generating; continue from it "
                                  "once it has finished", param="previous_response_id")
            history = previous.history + previous.output_messages
        history = history + input_messages(body.input)
        messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + history
        tools = chat_tools(body.tools)
        choice = openai_tool_choice(chat_tool_choice(body.tool_choice), tools, body.parallel_tool_calls)
        effort = body.reasoning.effort if body.reasoning is not None else None
        kwargs = template_kwargs(state.default_template_kwargs, body.chat_template_kwargs, **thinking_kwargs(effort))
        prompt = await run_in_threadpool(render_chat, state.tokenizer, messages,
                                         tools if choice.parse_tools else None, kwargs, True, state.max_model_len)
        plan = state.parsers.plan(prompt.text, tools, choice, requested_format(body.text),
                                  state.enable_auto_tool_choice)
        await compile_structure(state.engine.engine, plan.structure)
        max_tokens = output_budget(body.max_output_tokens, state.generation_defaults, state.max_model_len,
                                   len(prompt.token_ids))
        thinking = reply_thinking(state, prompt.text, tools if choice.parse_tools else None, kwargs, effort)
        params = build_sampling_params(
            thinking.sampling_defaults, state.parsers.keep_special_tokens, max_tokens=max_tokens,
            temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p, seed=body.seed,
            repetition_penalty=body.repetition_penalty, ignore_eos=body.ignore_eos,
            structured=plan.structure[0] if plan.structure is not None else None, **thinking.fields())
        response_id = new_id("resp_")
        turn = _Turn(render.ResponseHead(response_id, int(time.time()), model, _echo(body)), history,
                     state.parsers.pipeline(prompt.text, tools, plan), body.store, len(prompt.token_ids))
        stream = await state.submit(response_id, prompt.token_ids, params)
        in_flight[response_id] = stream
        if turn.store:
            store.put(render.response_object(turn.head, "in_progress", []), history, [])
        if body.stream:
            return EventStreamResponse(_events(state, store, in_flight, stream, turn))
        try:
            final = await until_disconnect(request, collect(state, stream))
        except APIError as exc:
            if exc.code != CANCELLED:  # the engine failed or the request timed out: stored as failed
                _settle(store, turn, _failed(turn, None, exc), "failed")
                raise
            return JSONResponse(_settle(store, turn, _cancelled(turn, None), CANCELLED))
        finally:
            in_flight.pop(response_id, None)
        if final is None:
            _settle(store, turn, None, "cancelled")
            return Response(status_code=CLIENT_CLOSED)
        renderer = render.ResponseEventRenderer()
        out = final.outputs[0]
        renderer.render(turn.pipeline.feed(out.text) + turn.pipeline.finish())
        status, reason = render.status_of(out.finish_reason)
        renderer.finish(status)
        return JSONResponse(_settle(store, turn, _finished(state, renderer, final, turn, status, reason), status))

    @router.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> JSONResponse:
        entry = store.get(response_id)
        if entry is None:
            raise _not_found(response_id)
        return JSONResponse(entry.response)

    @router.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> JSONResponse:
        if not store.delete(response_id):
            raise _not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    @router.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str) -> JSONResponse:
        entry = store.get(response_id)
        stream = in_flight.pop(response_id, None)
        if stream is None:
            if entry is None:
                raise _not_found(response_id)
            raise bad_request(f"response {response_id!r} is {entry.response['status']}; only a response still "
                              "generating can be cancelled", param="response_id")
        # the generating side reads this error next, answers "cancelled" and stores that
        stream.push(APIError(409, "the response was cancelled", code=CANCELLED))
        state.engine.abort(stream.request_id)
        if entry is None:  # store: false; the caller still learns it stopped
            return JSONResponse({"id": response_id, "object": "response", "status": CANCELLED})
        return JSONResponse({**entry.response, "status": CANCELLED})

    return router


def _cancelled(turn: _Turn, renderer: render.ResponseEventRenderer | None) -> dict:
    return render.response_object(turn.head, CANCELLED, renderer.output if renderer is not None else [])


def _failed(turn: _Turn, renderer: render.ResponseEventRenderer | None, err: APIError) -> dict:
    return render.response_object(turn.head, "failed", renderer.output if renderer is not None else [],
                                  error={"code": err.code or "server_error", "message": err.message})


def _finished(state: ServerState, renderer: render.ResponseEventRenderer, final: RequestOutput, turn: _Turn,
              status: str, reason: str | None) -> dict:
    out = final.outputs[0]
    reasoning = "".join(p["text"] for item in renderer.output if item["type"] == "reasoning"
                        for p in item["content"])
    # the engine counts tokens, not which were reasoning: tokenize the reasoning text back
    reasoning_tokens = min(len(out.token_ids), len(state.tokenizer.encode(reasoning, add_special_tokens=False))) \
        if reasoning and state.tokenizer is not None else 0
    usage = render.usage(len(final.prompt_token_ids), len(out.token_ids), final.num_cached_tokens, reasoning_tokens)
    return render.response_object(turn.head, status, renderer.output, usage, reason)


def _settle(store: ResponseStore, turn: _Turn, response: dict | None, status: str) -> dict | None:
    """Store the finished response (or mark it ``status`` when it has none) and return it."""
    if not turn.store:
        return response
    if response is None:
        entry = store.get(turn.head.id)
        if entry is not None and entry.response["status"] == "in_progress":
            store.update(turn.head.id, {**entry.response, "status": status})
        return None
    store.put(response, turn.history, output_messages(response["output"]))
    return response


async def _events(state: ServerState, store: ResponseStore, in_flight: dict[str, RequestStream], stream: RequestStream,
                  turn: _Turn) -> AsyncIterator[str]:
    renderer = render.ResponseEventRenderer()
    deltas = OutputDeltas()
    settled = False

    def emit(payload: dict) -> str:
        return sse_event(payload["type"], payload)

    try:
        snapshot = render.response_object(turn.head, "in_progress", [])
        yield emit(renderer.event("response.created", response=snapshot))
        yield emit(renderer.event("response.in_progress", response=snapshot))
        async for out in stream:
            for d in deltas.update(out):
                events = turn.pipeline.feed(d.text) if d.text else []
                if d.finished_now:
                    events += turn.pipeline.finish()
                for payload in renderer.render(events):
                    yield emit(payload)
                if d.finished_now:
                    status, reason = render.status_of(d.finish_reason)
                    for payload in renderer.finish(status):
                        yield emit(payload)
                    response = _settle(store, turn, _finished(state, renderer, out, turn, status, reason), status)
                    settled = True
                    kind = "response.completed" if status == "completed" else "response.incomplete"
                    yield emit(renderer.event(kind, response=response))
    except Exception as exc:
        settled = True
        if isinstance(exc, APIError) and exc.code == CANCELLED:
            cancelled = _cancelled(turn, renderer)
            _settle(store, turn, cancelled, CANCELLED)
            yield emit(renderer.event("response.incomplete", response=cancelled))
        else:
            failed = _failed(turn, renderer, engine_error(exc))
            _settle(store, turn, failed, "failed")
            yield emit(renderer.event("response.failed", response=failed))
    finally:
        in_flight.pop(turn.head.id, None)
        if not stream.done:
            state.engine.abort(stream.request_id)
        if not settled:
            _settle(store, turn, None, "cancelled")
