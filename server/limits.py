"""Per-request bounds (``n``, stop strings, tools, schema size and depth, the request timeout) and their 4xx refusals."""
from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from armillary.server.errors import APIError, bad_request

TIMEOUT_CODE = "request_timeout"


@dataclass(slots=True)
class RequestLimits:
    """``armillary serve``'s ``--max-n``, ``--max-stop-strings``, ``--max-tools``, ``--max-schema-bytes``,
    ``--max-schema-depth`` and ``--request-timeout`` (seconds; None: no limit)."""

    max_n: int = 128  # OpenAI's own bound on n
    max_stop_strings: int = 16
    max_tools: int = 128
    max_schema_bytes: int = 64 * 1024
    max_schema_depth: int = 32
    request_timeout_s: float | None = None

    # ---- one check per protocol body

    def check_chat(self, body: Any) -> None:
        self._n(body.n)
        self._stops(body.stop, "stop")
        self._tools([t.function.parameters for t in body.tools or []], "tools")
        if body.response_format is not None and body.response_format.json_schema is not None:
            self._schema(body.response_format.json_schema.schema_, "response_format.json_schema.schema")
        self._guided(body)

    def check_completion(self, body: Any) -> None:
        self._n(body.n)
        self._stops(body.stop, "stop")
        self._guided(body)

    def check_messages(self, body: Any) -> None:
        self._stops(getattr(body, "stop_sequences", None), "stop_sequences")
        self._tools([t.input_schema for t in body.tools or []], "tools")
        for fmt, param in ((body.output_format, "output_format.schema"),
                           (body.output_config.format if body.output_config is not None else None,
                            "output_config.format.schema")):
            if fmt is not None:
                self._schema(fmt.schema_, param)

    def check_responses(self, body: Any) -> None:
        self._tools([t.parameters for t in body.tools or []], "tools")
        fmt = body.text.format if body.text is not None else None
        if fmt is not None:
            self._schema(fmt.schema_, "text.format.schema")

    # ---- the bounds

    def _n(self, n: int) -> None:
        if n > self.max_n:
            raise bad_request(f"n is {n}, over this server's limit of {self.max_n} (--max-n)", param="n")

    def _stops(self, stop: str | list[str] | None, param: str) -> None:
        if isinstance(stop, list) and len(stop) > self.max_stop_strings:
            raise bad_request(f"{param} has {len(stop)} strings, over this server's limit of "
                              f"{self.max_stop_strings} (--max-stop-strings)", param=param)

    def _tools(self, schemas: list[Any], param: str) -> None:
        if len(schemas) > self.max_tools:
            raise bad_request(f"{param} has {len(schemas)} tools, over this server's limit of {self.max_tools} "
                              "(--max-tools)", param=param)
        for i, schema in enumerate(schemas):
            self._schema(schema, f"{param}[{i}]")

    def _guided(self, body: Any) -> None:
        self._schema(body.guided_json, "guided_json")
        if body.structured_outputs is not None:
            self._schema(body.structured_outputs.get("json"), "structured_outputs.json")
        if body.response_format is not None and body.response_format.json_schema is not None:
            self._schema(body.response_format.json_schema.schema_, "response_format.json_schema.schema")

    def _schema(self, schema: Any, param: str) -> None:
        if schema is None:
            return
        depth = nesting_depth(schema)  # first: serializing a deep one recurses
        if depth > self.max_schema_depth:
            raise bad_request(f"{param} nests {depth} levels deep, over this server's limit of "
                              f"{self.max_schema_depth} (--max-schema-depth)", param=param)
        size = len(json.dumps(schema, separators=(",", ":"), default=str))
        if size > self.max_schema_bytes:
            raise bad_request(f"{param} is {size} bytes of JSON, over this server's limit of "
                              f"{self.max_schema_bytes} (--max-schema-bytes)", param=param)

    # ---- the timeout

    def arm_timeout(self, stream: Any, abort: Any) -> None:
        """After ``request_timeout_s``, a stream still running reads a 408 and its request is aborted."""
        if self.request_timeout_s is None:
            return
        timeout = self.request_timeout_s

        def expire() -> None:
            if stream.done:
                return
            stream.push(APIError(408, f"the request ran past this server's limit of {timeout:g} s "
                                      "(--request-timeout)", code=TIMEOUT_CODE))
            abort(stream.request_id)

        asyncio.get_running_loop().call_later(timeout, expire)


def nesting_depth(value: Any) -> int:
    """Levels of dicts and lists (a scalar is 0), without recursion: a hostile schema cannot blow the stack."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        children: Iterable[Any]
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        depth += 1
        deepest = max(deepest, depth)
        stack.extend((child, depth) for child in children)
    return deepest
