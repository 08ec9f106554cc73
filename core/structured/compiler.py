"""Compiles ``StructuredSpec`` constraints with xgrammar, once per distinct constraint (LRU cache).

Thread-safe: the server compiles a request's constraint on a worker thread before handing the
request to the engine (so a bad schema is a 400 and a slow compile never stalls a step); the
engine's own compile of the same spec is then a cache hit.
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any

from armillary.errors import InvalidRequestError
from armillary.structured import spec as kinds
from armillary.structured.json_schema import prepare_json_schema
from armillary.structured.spec import StructuredSpec
from armillary.structured.utf8 import Utf8Guard

# JSON is written compactly (", " and ": " separators, no other whitespace): a model cannot pad
# its output with whitespace forever, and every reply has one layout.
_JSON_OPTIONS = {"any_whitespace": False, "strict_mode": True}
# the newlines chat templates put between a closed reasoning block and the reply (parsers drop them)
_AFTER_REASONING = {"type": "regex", "pattern": "\\n{0,2}"}
# xgrammar prefixes its errors with a timestamp and a C++ source location; the client needs neither
_ERROR_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*|Check failed: \(.*?\) is false:\s*")


def xgrammar_message(exc: BaseException) -> str:
    """The useful part of an xgrammar error: its first line without source locations."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    text = lines[0] if lines else type(exc).__name__
    return _ERROR_PREFIX.sub("", _ERROR_PREFIX.sub("", text)).strip()


def choice_ebnf(options: list[str]) -> str:
    """EBNF for exactly one of ``options`` (JSON string escapes are valid EBNF literal escapes)."""
    return "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)


class GrammarCompiler:
    """``compile(spec)`` -> xgrammar ``CompiledGrammar``; raises ``InvalidRequestError`` naming the problem.

    ``tokenizer``: armillary's ``Tokenizer``; ``vocab_size``: the model's vocabulary (mask width);
    ``stop_token_ids``: the tokens that end a completed grammar. xgrammar and the tokenizer
    info are loaded on the first compile, so engines that never constrain output never pay for them.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...],
                 max_cached: int = 256) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self.max_cached = max_cached
        self._compiler = None
        self.utf8_guard: Utf8Guard | None = None  # set with the tokenizer info, on the first compile
        self._cache: OrderedDict[StructuredSpec, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0  # cache misses, for tests and metrics

    def compile(self, spec: StructuredSpec) -> Any:
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        compiled = self._compile(spec)  # outside the lock: compiles of different specs run in parallel
        with self._lock:
            self._cache[spec] = compiled
            self._cache.move_to_end(spec)
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
            self.num_compiled += 1
        return compiled

    def _xgrammar_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                if self.tokenizer is None:
                    raise InvalidRequestError("structured output needs the model's tokenizer, and this model has none")
                try:
                    import xgrammar as xgr
                except ImportError as exc:
                    raise InvalidRequestError("structured output needs the xgrammar package: pip install xgrammar") \
                        from exc
                from armillary.structured.tokenizer_info import build_tokenizer_info

                info = build_tokenizer_info(self.tokenizer, self.vocab_size, self.stop_token_ids)
                self.utf8_guard = Utf8Guard(info.decoded_vocab, self.vocab_size)
                # armillary keeps its own LRU of compiled grammars; xgrammar's would hold a second copy
                self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
            return self._compiler

    def _compile(self, spec: StructuredSpec) -> Any:
        compiler = self._xgrammar_compiler()
        import xgrammar as xgr

        try:
            if spec.reasoning_end is None and spec.kind != kinds.STRUCTURAL_TAG:
                compiled = compiler.compile_grammar(self._grammar(xgr, spec))
            else:
                compiled = compiler.compile_structural_tag(json.dumps(self._structural_tag(xgr, spec)))
        except (RuntimeError, ValueError, TypeError) as exc:
            raise InvalidRequestError(f"invalid {spec.describe()}: {xgrammar_message(exc)}") from exc
        if not self._admits_some_output(xgr, compiled):
            raise InvalidRequestError(f"invalid {spec.describe()}: no output can satisfy it")
        return compiled

    @staticmethod
    def _grammar(xgr: Any, spec: StructuredSpec) -> Any:
        """An xgrammar ``Grammar`` for every kind but ``structural_tag``."""
        if spec.kind == kinds.JSON_SCHEMA:
            schema = prepare_json_schema(json.loads(spec.source))
            return xgr.Grammar.from_json_schema(json.dumps(schema), **_JSON_OPTIONS)
        if spec.kind == kinds.JSON_OBJECT:
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if spec.kind == kinds.REGEX:
            return xgr.Grammar.from_regex(spec.source)
        if spec.kind == kinds.CHOICE:
            return xgr.Grammar.from_ebnf(choice_ebnf(json.loads(spec.source)))
        return xgr.Grammar.from_ebnf(spec.source)

    def _structural_tag(self, xgr: Any, spec: StructuredSpec) -> dict:
        """The spec as a structural tag; after a reasoning block: free text up to its end tag first."""
        if spec.kind == kinds.STRUCTURAL_TAG:
            body = _prepare_formats(xgr, json.loads(spec.source)["format"])
        else:
            body = {"type": "grammar", "grammar": str(self._grammar(xgr, spec))}
        if spec.reasoning_end is not None:
            reasoning = {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": spec.reasoning_end}
            body = {"type": "sequence", "elements": [reasoning, _AFTER_REASONING, body]}
        return {"type": "structural_tag", "format": body}

    def _admits_some_output(self, xgr: Any, compiled: Any) -> bool:
        """A grammar whose language is empty would leave a sequence no token to pick."""
        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(bitmask)
        return bool(bitmask.any())


def _prepare_formats(xgr: Any, node: Any) -> Any:
    """A structural tag whose JSON-style schema formats are compact-JSON grammars of prepared schemas."""
    if isinstance(node, list):
        return [_prepare_formats(xgr, item) for item in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and isinstance(node.get("json_schema"), dict):
        schema = json.dumps(prepare_json_schema(node["json_schema"]))
        if node.get("style", "json") != "json":
            return {**node, "json_schema": json.loads(schema)}
        return {"type": "grammar", "grammar": str(xgr.Grammar.from_json_schema(schema, **_JSON_OPTIONS))}
    return {key: _prepare_formats(xgr, value) for key, value in node.items()}
