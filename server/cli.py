"""``armillary serve``: flags, start-up (one log line per stage), uvicorn, graceful shutdown."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import uvicorn

from armillary.config import EngineConfig
from armillary.errors import ArmillaryError
from armillary.registry import PluginRegistry, default_registry

log = logging.getLogger("armillary.server")

API_KEY_ENV = "ARMILLARY_API_KEY"

# flag dest -> EngineConfig field; flags default to None so EngineConfig keeps its own defaults
_ENGINE_FLAGS: tuple[tuple[str, type | None, str], ...] = (
    ("tokenizer", str, "tokenizer directory or repo id (default: the model's)"),
    ("revision", str, "Hugging Face revision of the model"),
    ("max_model_len", int, "context length limit (default: the checkpoint's)"),
    ("max_num_seqs", int, "most sequences running at once"),
    ("max_num_batched_tokens", int, "token budget of one step (decodes plus prefill chunks)"),
    ("block_size", int, "tokens per paged KV block"),
    ("gpu_memory_utilization", float, "fraction of GPU memory the engine may use"),
    ("cpu_kv_cache_space_gb", float, "KV and state cache budget in GiB when running on the CPU"),
    ("num_kv_blocks", int, "override the memory planner's KV block count"),
    ("dtype", str, "weights and activations dtype: auto, bfloat16, float16, float32"),
    ("seed", int, "engine random seed"),
    ("device", str, "auto, cuda, cuda:N or cpu"),
    ("load_format", str, "auto, or dummy for random weights"),
    ("kernel_backend", str, "auto (Triton on CUDA), reference (plain torch everywhere) or triton"),
    ("max_graph_batch", int, "largest decode batch captured in a CUDA graph"),
)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_serve_args(parser: argparse.ArgumentParser, registry: PluginRegistry | None = None) -> None:
    """``armillary serve [MODEL] [--model MODEL] ...`` plus what plugins add (``armillary_add_cli_args``)."""
    parser.add_argument("model_positional", nargs="?", metavar="MODEL",
                        help="checkpoint directory or Hugging Face repo id (local cache)")
    parser.add_argument("--model", dest="model_option", metavar="MODEL", help="same as MODEL")
    net = parser.add_argument_group("server")
    net.add_argument("--host", default="127.0.0.1")
    net.add_argument("--port", type=int, default=8888, help="0 picks a free port (logged at start-up)")
    net.add_argument("--served-model-name", nargs="+", help="names clients use (default: MODEL as given)")
    net.add_argument("--api-key", help=f"require this key (also ${API_KEY_ENV}); without one the server is open")
    net.add_argument("--max-queue-size", type=_positive_int,
                     help="most requests waiting for their first token; more get 503 with Retry-After")
    net.add_argument("--max-request-body-bytes", type=_positive_int, default=32 * 1024 * 1024,
                     help="larger request bodies get 413")
    net.add_argument("--tool-call-parser", help="tool-call parser name, or 'none' (default: the model's)")
    net.add_argument("--reasoning-parser", help="reasoning parser name, or 'none' (default: the model's)")
    net.add_argument("--default-chat-template-kwargs", type=_json_object, default={},
                     help='JSON object of chat template variables, e.g. \'{"enable_thinking": false}\'')
    net.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    eng = parser.add_argument_group("engine")
    for dest, kind, help_text in _ENGINE_FLAGS:
        eng.add_argument("--" + dest.replace("_", "-"), dest=dest, type=kind, help=help_text)
    eng.add_argument("--enforce-eager", action="store_true", default=None, help="no CUDA graphs")
    eng.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                     help="launch the next decode step before reading the last one's tokens (default: on CUDA)")
    eng.add_argument("--enable-prefix-caching", action="store_true", default=None,
                     help="reuse KV blocks and state snapshots of shared prompt prefixes")
    before = {action.dest for action in parser._actions}
    try:
        (registry or default_registry()).hook.armillary_add_cli_args(parser=parser)
    except ArmillaryError as exc:  # a broken plugin must not break --help; serving reports it again
        log.warning("plugin flags unavailable: %s", exc)
    parser.set_defaults(plugin_arg_names=sorted({action.dest for action in parser._actions} - before))


def engine_config(args: argparse.Namespace, model: str) -> EngineConfig:
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    values = {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
    values["model"] = model
    values["plugin_args"] = {name: getattr(args, name) for name in getattr(args, "plugin_arg_names", [])}
    return EngineConfig(**values)


def _setup_logging(level: str) -> None:
    logger = logging.getLogger("armillary")
    logger.setLevel(level.upper())
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)


class _Server(uvicorn.Server):
    """uvicorn that aborts in-flight requests on SIGINT / SIGTERM and exits normally afterwards."""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_signal = on_signal

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn re-raises the signal after shutdown, which would turn a clean stop into exit 130 / -15
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.should_exit:
            log.info("%s: no new requests, aborting the ones in flight", signal.Signals(sig).name)
            self._on_signal()
        super().handle_exit(sig, frame)

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.started and self.servers:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            shown = f"[{host}]" if ":" in host else host
            log.info("listening on http://%s:%d", shown, port)


def run_serve(args: argparse.Namespace) -> int:
    from armillary.engine import LLMEngine
    from armillary.server.app import build_app
    from armillary.server.async_engine import AsyncEngine
    from armillary.server.metrics import ServerMetrics
    from armillary.server.parsing import ParserSetup
    from armillary.server.state import ServerState

    _setup_logging(args.log_level)
    model = args.model_option or args.model_positional
    try:
        registry = default_registry()
        if not model:
            model = registry.hook.armillary_default_model()
            if not model:
                log.error("no model: give MODEL or --model (no installed plugin offers a default model)")
                return 2
            log.info("no model named: serving the default model %s", model)
            if not args.served_model_name:  # clients name it by its model name, not its file path
                args.served_model_name = [Path(model).name.split(".")[0]]
    except ArmillaryError as exc:
        log.error("%s", exc)
        return 1
    plugins = ", ".join(f"{i.name} {i.version}".strip() + (f" ({', '.join(i.architectures)})" if i.architectures else "")
                        for i in registry.infos.values())
    log.info("plugins found: %s", plugins)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if api_key is None:
        log.warning("no API key set (--api-key or $%s): the server answers anyone who can reach %s:%d",
                    API_KEY_ENV, args.host, args.port)
    config = engine_config(args, model)
    log.info("loading %s", model)
    engine = AsyncEngine(lambda: LLMEngine(config, registry), max_queue_size=args.max_queue_size)
    metrics = ServerMetrics(engine.stats)
    engine.observer = metrics
    engine.start()
    try:
        engine.wait_until_loaded()
        loaded = engine.engine
        parsers = ParserSetup.resolve(registry, loaded.arch, loaded.tokenizer, args.tool_call_parser,
                                      args.reasoning_parser)
    except KeyboardInterrupt:
        log.info("interrupted while loading")
        return 0
    except (ArmillaryError, OSError, ValueError) as exc:  # what a user can fix: say it in one line
        log.error("cannot serve %s: %s", model, exc)
        engine.shutdown(timeout=5)
        return 1
    except Exception:
        log.exception("cannot serve %s", model)
        engine.shutdown(timeout=5)
        return 1
    log.info("parsers: %s", parsers.describe())
    state = ServerState(engine, list(args.served_model_name or [model]), parsers, metrics, api_key,
                        dict(args.default_chat_template_kwargs), args.max_request_body_bytes)
    app = build_app(state)
    server = _Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", access_log=False,
                                    lifespan="off", timeout_graceful_shutdown=10), on_signal=engine.begin_shutdown)
    try:
        server.run()
    except SystemExit as exc:  # uvicorn exits when it cannot bind
        engine.shutdown(timeout=5)
        return int(exc.code or 1)
    engine.shutdown(timeout=10)
    log.info("stopped")
    return 0
