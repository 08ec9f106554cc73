"""OpenAI routes: ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from armillary.outputs import RequestOutput, TokenLogprob
from armillary.parsers.base import ParserPipeline
from armillary.server import openai_render as render
from armillary.server.errors import bad_request, not_supported, openai_error_body
from armillary.server.prompts import (
    context_length_error,
    encode_prompt,
    openai_messages,
    openai_tool_choice,
    openai_tools,
    render_chat,
    template_kwargs,
)
from armillary.server.protocol_openai import ChatCompletionRequest, CompletionRequest, SamplingFields
from armillary.server.responses_input import thinking_kwargs
from armillary.server.async_engine import RequestStream
from armillary.server.sampling import (
    RequestedStructure,
    build_sampling_params,
    check_logprobs,
    compile_structure,
    output_budget,
    refuse_prompt_logprobs,
    requested_structure,
)
from armillary.server.state import ServerState, engine_error, new_id, parse_body, read_json
from armillary.server.streaming import (
    SSE_DONE,
    EventStreamResponse,
    OutputDeltas,
    sse_data,
    until_disconnect,
)
from armillary.server.thinking import ReplyThinking, reply_thinking

CLIENT_CLOSED = 499  # nginx's status for a request the client abandoned; nobody reads the reply


def _common_checks(body: SamplingFields) -> None:
    if body.logit_bias:
        raise not_supported("logit_bias", param="logit_bias")
    if body.n < 1:
        raise bad_request(f"n must be at least 1, got {body.n}", param="n")
    refuse_prompt_logprobs(body)


def _sampling(state: ServerState, body: SamplingFields, max_tokens: int | None, logprobs: int | None,
              structure: RequestedStructure | None, thinking: ReplyThinking | None = None):
    """``thinking``: a chat reply's mode defaults and budget (None: a completion, generation_config.json only)."""
    return build_sampling_params(
        thinking.sampling_defaults if thinking is not None else state.generation_defaults,
        state.parsers.keep_special_tokens, **(thinking.fields() if thinking is not None else {}),
        n=body.n, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty, seed=body.seed, stop=body.stop,
        stop_token_ids=body.stop_token_ids, max_tokens=max_tokens, min_tokens=body.min_tokens,
        ignore_eos=body.ignore_eos, logprobs=logprobs, skip_special_tokens=body.skip_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
        structured=structure[0] if structure is not None else None)


async def collect(state: ServerState, stream: RequestStream) -> RequestOutput:
    """The finished output of one request; aborts it if the caller is cancelled."""
    final = None
    try:
        async for out in stream:
            final = out
    except Exception as exc:
        raise engine_error(exc) from exc
    finally:
        if not stream.done:
            state.engine.abort(stream.request_id)
    return final


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come, tagged with the request's position."""
    tasks = {asyncio.ensure_future(s.__anext__()): k for k, s in enumerate(streams)}
    try:
        while tasks:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                k = tasks.pop(task)
                try:
                    out = task.result()
                except StopAsyncIteration:
                    continue
                tasks[asyncio.ensure_future(streams[k].__anext__())] = k
                yield k, out
    finally:
        for task in tasks:
            task.cancel()


def build_router(state: ServerState) -> APIRouter:
    router = APIRouter()

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": state.created, "owned_by": "armillary",
                "root": name, "max_model_len": state.max_model_len}

    @router.get("/v1/models")
    async def list_models() -> JSONResponse:
        state.require_ready()
        return JSONResponse({"object": "list", "data": [model_card(n) for n in state.served_model_names]})

    @router.get("/v1/models/{model:path}")
    async def get_model(model: str) -> JSONResponse:
        name = state.model_name(model)
        state.require_ready()
        return JSONResponse(model_card(name))

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = parse_body(ChatCompletionRequest, await read_json(request, state.max_body_bytes))
        model = state.model_name(body.model)
        state.require_ready()
        _common_checks(body)
        state.limits.check_chat(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
        check_logprobs(body.top_logprobs, state.max_logprobs, "top_logprobs")
        tools = openai_tools(body.tools)
        choice = openai_tool_choice(body.tool_choice, tools, body.parallel_tool_calls)
        requested = requested_structure(body)
        # reasoning_effort "none" turns thinking off (as the Responses API's); others reach the template too
        kwargs = template_kwargs(state.default_template_kwargs, body.chat_template_kwargs,
                                 **thinking_kwargs(body.reasoning_effort))
        messages = openai_messages(body.messages)
        # rendering and tokenizing a long conversation takes a while: never on the event loop
        prompt = await run_in_threadpool(render_chat, state.tokenizer, messages,
                                         tools if choice.parse_tools else None, kwargs, body.add_generation_prompt,
                                         state.max_model_len)
        requested_max = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = output_budget(requested_max, state.generation_defaults, state.max_model_len,
                                   len(prompt.token_ids))
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        plan = state.parsers.plan(prompt.text, tools, choice, requested, state.enable_auto_tool_choice)
        await compile_structure(state.engine.engine, plan.structure)
        thinking = reply_thinking(state, prompt.text, tools if choice.parse_tools else None, kwargs,
                                  body.reasoning_effort)
        params = _sampling(state, body, max_tokens, logprobs, plan.structure, thinking)
        pipelines = [state.parsers.pipeline(prompt.text, tools, plan) for _ in range(body.n)]
        request_id = new_id("chatcmpl-")
        head = render.ResponseHeader(request_id, int(time.time()), model)
        stream = await state.submit(request_id, prompt.token_ids, params)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return EventStreamResponse(_chat_events(state, stream, head, pipelines, include_usage,
                                                    logprobs is not None))
        final = await until_disconnect(request, collect(state, stream))
        if final is None:
            return Response(status_code=CLIENT_CLOSED)
        choices = []
        for c in final.outputs:
            parsed = pipelines[c.index].parse_complete(c.text)
            choices.append({
                "index": c.index, "message": render.chat_message(parsed),
                "logprobs": render.chat_logprobs(c.logprobs or [], state.token_text) if logprobs is not None else None,
                "finish_reason": render.finish_reason(c.finish_reason, bool(parsed.tool_calls)),
            })
        completion_tokens = sum(len(c.token_ids) for c in final.outputs)
        return JSONResponse(render.chat_response(head, choices, len(final.prompt_token_ids), completion_tokens,
                                                 final.num_cached_tokens))

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = parse_body(CompletionRequest, await read_json(request, state.max_body_bytes))
        model = state.model_name(body.model)
        state.require_ready()
        _common_checks(body)
        state.limits.check_completion(body)
        if body.suffix is not None:
            raise not_supported("suffix", param="suffix")
        if body.echo and body.logprobs is not None:
            raise not_supported("echo with logprobs (prompt logprobs)", param="echo")
        if body.best_of is not None and body.best_of != body.n:
            raise not_supported("best_of other than n", param="best_of")
        check_logprobs(body.logprobs, state.max_logprobs, "logprobs")
        prompts = _prompt_list(body.prompt)
        token_prompts = await run_in_threadpool(_prompt_ids, state, prompts)
        structure = requested_structure(body)
        await compile_structure(state.engine.engine, structure)
        # null max_tokens: the rest of the context (of the longest prompt, when a default caps it)
        max_tokens = output_budget(body.max_tokens, state.generation_defaults, state.max_model_len,
                                   max(len(ids) for ids in token_prompts))
        params = _sampling(state, body, max_tokens, body.logprobs, structure)
        echoes = [_echo_text(state, p, ids) if body.echo else "" for p, ids in zip(prompts, token_prompts)]
        request_id = new_id("cmpl-")
        streams: list[RequestStream] = []
        try:
            for k, ids in enumerate(token_prompts):
                streams.append(await state.submit(f"{request_id}-{k}", ids, params))
        except BaseException:
            for s in streams:
                state.engine.abort(s.request_id)
            raise
        head = render.ResponseHeader(request_id, int(time.time()), model)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return EventStreamResponse(_completion_events(state, streams, head, body.n, echoes, include_usage,
                                                          body.logprobs is not None))
        finals = await until_disconnect(request, asyncio.gather(*(collect(state, s) for s in streams)))
        if finals is None:
            return Response(status_code=CLIENT_CLOSED)
        choices = []
        for k, final in enumerate(finals):
            for c in final.outputs:
                lp = (render.completion_logprobs(c.logprobs or [], state.token_text, 0)
                      if body.logprobs is not None else None)
                choices.append({"index": k * body.n + c.index, "text": echoes[k] + c.text, "logprobs": lp,
                                "finish_reason": c.finish_reason})
        prompt_tokens = sum(len(f.prompt_token_ids) for f in finals)
        completion_tokens = sum(len(c.token_ids) for f in finals for c in f.outputs)
        cached_tokens = sum(f.num_cached_tokens for f in finals)
        return JSONResponse(render.completion_response(head, choices, prompt_tokens, completion_tokens, cached_tokens))

    return router


def _prompt_list(prompt: str | list) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def _prompt_ids(state: ServerState, prompts: list[str | list[int]]) -> list[list[int]]:
    """Each prompt's token ids, refusing one that leaves no room to generate (blocking: a worker thread)."""
    out = []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, list):
            if len(prompt) >= state.max_model_len:
                raise context_length_error(f"prompt {index} has {len(prompt)} tokens; this model's maximum context "
                                           f"length is {state.max_model_len}, prompt and output together", "prompt")
            out.append(prompt)
            continue
        if state.tokenizer is None:
            raise bad_request("this model has no tokenizer: give the prompt as token ids", param="prompt")
        ids = encode_prompt(state.tokenizer, prompt, True, state.max_model_len, "prompt")
        if not ids:
            raise bad_request(f"prompt {index} is empty", param="prompt")
        out.append(ids)
    return out


def _echo_text(state: ServerState, prompt: str | list[int], ids: list[int]) -> str:
    if isinstance(prompt, str):
        return prompt
    return state.tokenizer.decode(ids, skip_special_tokens=False) if state.tokenizer is not None else ""


async def _chat_events(state: ServerState, stream: RequestStream, head: render.ResponseHeader,
                       pipelines: list[ParserPipeline], include_usage: bool,
                       want_logprobs: bool) -> AsyncIterator[str]:
    n = len(pipelines)
    renderers = [render.ChatDeltaRenderer() for _ in range(n)]
    pending: list[list[TokenLogprob]] = [[] for _ in range(n)]
    deltas = OutputDeltas()
    usage = (0, 0, 0)

    def take_logprobs(i: int) -> dict | None:
        if not want_logprobs or not pending[i]:
            return None
        entries, pending[i] = pending[i], []
        return render.chat_logprobs(entries, state.token_text)

    try:
        for i in range(n):
            yield sse_data(render.chat_chunk(head, i, {"role": "assistant", "content": ""},
                                             with_usage_field=include_usage))
        async for out in stream:
            usage = (len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs), out.num_cached_tokens)
            for d in deltas.update(out):
                events = pipelines[d.index].feed(d.text) if d.text else []
                if d.finished_now:
                    events += pipelines[d.index].finish()
                pending[d.index].extend(d.logprobs)
                renderer = renderers[d.index]
                for delta in renderer.render(events, final=d.finished_now):
                    yield sse_data(render.chat_chunk(head, d.index, delta, logprobs=take_logprobs(d.index),
                                                     with_usage_field=include_usage))
                if d.finished_now:
                    reason = render.finish_reason(d.finish_reason, renderer.has_tool_calls)
                    yield sse_data(render.chat_chunk(head, d.index, {}, reason, logprobs=take_logprobs(d.index),
                                                     with_usage_field=include_usage))
        if include_usage:
            yield sse_data(render.usage_chunk(head, "chat.completion.chunk", *usage))
    except Exception as exc:
        yield sse_data(openai_error_body(engine_error(exc)))
    finally:
        if not stream.done:
            state.engine.abort(stream.request_id)
    yield SSE_DONE


async def _completion_events(state: ServerState, streams: list[RequestStream], head: render.ResponseHeader, n: int,
                             echoes: list[str], include_usage: bool, want_logprobs: bool) -> AsyncIterator[str]:
    trackers = [OutputDeltas() for _ in streams]
    offsets: dict[int, int] = {}  # choice index -> text offset of its next token (logprobs)
    prompt_tokens = [0] * len(streams)
    completion_tokens = [0] * len(streams)
    cached_tokens = [0] * len(streams)
    try:
        for k, echo in enumerate(echoes):
            if echo:
                for j in range(n):
                    yield sse_data(render.completion_chunk(head, k * n + j, echo, with_usage_field=include_usage))
        async for k, out in merge_streams(streams):
            prompt_tokens[k] = len(out.prompt_token_ids)
            completion_tokens[k] = sum(len(c.token_ids) for c in out.outputs)
            cached_tokens[k] = out.num_cached_tokens
            for d in trackers[k].update(out):
                index = k * n + d.index
                lp = None
                if want_logprobs and d.logprobs:
                    start = offsets.get(index, 0)
                    lp = render.completion_logprobs(d.logprobs, state.token_text, start)
                    offsets[index] = start + sum(len(t) for t in lp["tokens"])
                if d.text or lp is not None or d.finished_now:
                    yield sse_data(render.completion_chunk(head, index, d.text, d.finish_reason, lp,
                                                           with_usage_field=include_usage))
        if include_usage:
            yield sse_data(render.usage_chunk(head, "text_completion", sum(prompt_tokens), sum(completion_tokens),
                                              sum(cached_tokens)))
    except Exception as exc:
        yield sse_data(openai_error_body(engine_error(exc)))
    finally:
        for s in streams:
            if not s.done:
                state.engine.abort(s.request_id)
    yield SSE_DONE

