"""Request fields -> ``SamplingParams``, with the checkpoint's generation_config.json as defaults (as vLLM),
and the structured-output fields -> the ``StructuredSpec`` they ask for."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.concurrency import run_in_threadpool

from armillary.errors import InvalidRequestError
from armillary.sampling_params import SamplingParams
from armillary.server.errors import bad_request, not_supported
from armillary.structured.spec import StructuredSpec

# generation_config.json keys that fill a field the request left unset.
_DEFAULTABLE = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                "frequency_penalty")


def build_sampling_params(generation_defaults: dict[str, Any], keep_special_tokens: bool = False,
                          max_tokens: int | None = None, **fields: Any) -> SamplingParams:
    """``fields`` are ``SamplingParams`` arguments; None means "not given by the request".

    ``max_tokens``: None generates up to the rest of the context (see ``output_budget``). Unset
    sampling knobs take generation_config.json's value when it has one, else ``SamplingParams``'
    default. ``keep_special_tokens`` forces ``skip_special_tokens=False`` so parsers see markup
    that the tokenizer marks special. Raises ``InvalidRequestError``.
    """
    given = {k: v for k, v in fields.items() if v is not None}
    given["max_tokens"] = max_tokens
    for key in _DEFAULTABLE:
        if key not in given and generation_defaults.get(key) is not None:
            given[key] = generation_defaults[key]
    if keep_special_tokens:
        given["skip_special_tokens"] = False
    return SamplingParams(**given)


def output_budget(requested: int | None, generation_defaults: dict[str, Any], max_model_len: int,
                  prompt_tokens: int) -> int | None:
    """The ``max_tokens`` of a request, as vLLM: the request's own; else generation_config.json's
    ``max_new_tokens`` within the room the prompt leaves; else None, the rest of the context."""
    if requested is not None:
        return requested
    default = generation_defaults.get("max_new_tokens")
    room = max_model_len - prompt_tokens
    if isinstance(default, int) and default > 0 and room > 0:
        return min(default, room)
    return None


def check_logprobs(value: int | None, limit: int, param: str) -> None:
    """``logprobs`` / ``top_logprobs`` within ``--max-logprobs``."""
    if value is None:
        return
    if value < 0:
        raise bad_request(f"{param} must be 0 or more, got {value}", param=param)
    if value > limit:
        raise bad_request(f"{param} is {value}, over this server's limit of {limit} (--max-logprobs {limit})",
                          param=param)


def refuse_prompt_logprobs(body: Any) -> None:
    """vLLM's ``prompt_logprobs``: not computed by this engine yet, so asked for it is a 400, never ignored."""
    if getattr(body, "prompt_logprobs", None) is not None:
        raise not_supported("prompt_logprobs (log-probabilities of the prompt tokens)", param="prompt_logprobs")


# ---- structured output

RequestedStructure = tuple[StructuredSpec, str]  # the constraint and the request field it came from


def _spec(param: str, make: Callable[[], StructuredSpec]) -> RequestedStructure:
    try:
        return make(), param
    except InvalidRequestError as exc:
        raise bad_request(str(exc), param=param) from exc


def _response_format(fmt: Any) -> RequestedStructure | None:
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredSpec.json_object(), "response_format"
    if fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise bad_request("response_format.json_schema.schema is required", param="response_format.json_schema")
        return _spec("response_format.json_schema.schema",
                     lambda: StructuredSpec.json_schema(fmt.json_schema.schema_, "response_format.json_schema.schema"))
    if fmt.type == "structural_tag":
        return _spec("response_format",
                     lambda: StructuredSpec.structural_tag({"format": fmt.format}, "response_format"))
    raise bad_request(f"response_format.type must be 'text', 'json_object', 'json_schema' or 'structural_tag', "
                      f"got {fmt.type!r}", param="response_format.type")


def _structured_outputs(fields: dict[str, Any]) -> RequestedStructure | None:
    """vLLM's ``structured_outputs``: one of json, regex, choice, grammar, json_object, structural_tag."""
    makers: dict[str, Callable[[Any, str], StructuredSpec]] = {
        "json": StructuredSpec.json_schema, "regex": StructuredSpec.regex, "choice": StructuredSpec.choice,
        "grammar": StructuredSpec.grammar, "structural_tag": StructuredSpec.structural_tag,
        "json_object": lambda value, where: StructuredSpec.json_object(),
    }
    given = [k for k in makers if fields.get(k) not in (None, False)]
    if len(given) > 1:
        raise bad_request(f"structured_outputs sets {', '.join(given)}; give one", param="structured_outputs")
    if not given:
        return None
    key = given[0]
    return _spec(f"structured_outputs.{key}", lambda: makers[key](fields[key], f"structured_outputs.{key}"))


def requested_structure(body: Any) -> RequestedStructure | None:
    """The output constraint an OpenAI-style body asks for, if any; 400 when it asks for several."""
    found: list[RequestedStructure] = []
    if body.response_format is not None:
        found.append(_response_format(body.response_format))
    if body.structured_outputs is not None:
        found.append(_structured_outputs(body.structured_outputs))
    guided = {"guided_json": StructuredSpec.json_schema, "guided_regex": StructuredSpec.regex,
              "guided_choice": StructuredSpec.choice, "guided_grammar": StructuredSpec.grammar}
    for name, make in guided.items():
        value = getattr(body, name)
        if value is not None:
            found.append(_spec(name, lambda make=make, value=value, name=name: make(value, name)))
    found = [f for f in found if f is not None]
    if len(found) > 1:
        raise bad_request(f"{' and '.join(param for _, param in found)} each constrain the output; give one",
                          param=found[1][1])
    return found[0] if found else None


async def compile_structure(engine: Any, requested: RequestedStructure | None) -> None:
    """Compile the constraint on a worker thread (cached for the engine): a bad one is a 400 naming its field."""
    if requested is None:
        return
    spec, param = requested
    try:
        await run_in_threadpool(engine.structured.compile, spec)
    except InvalidRequestError as exc:
        raise bad_request(str(exc), param=param) from exc
