"""``armillary serve``: start-up (one log line per stage), uvicorn, graceful shutdown; the flags are in flags.py."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import re
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import uvicorn

from armillary.config import EngineConfig
from armillary.registry import PluginRegistry, default_registry
from armillary.server.flags import (
    API_KEY_ENV,
    add_serve_args,
    check_thinking_budget,
    engine_config,
    template_defaults,
)
from armillary.server.startup_checks import StartupError, bind_listening_socket, check_parser_names, describe_failure

__all__ = ["add_serve_args", "engine_config", "run_serve"]  # core/cli.py and tests import the flags from here

log = logging.getLogger("armillary.server")

def _setup_logging(level: str) -> None:
    logger = logging.getLogger("armillary")
    logger.setLevel(level.upper())
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)


class _Server(uvicorn.Server):
    """uvicorn that aborts in-flight requests on SIGINT / SIGTERM and exits normally afterwards."""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[], None], throughput: Any = None,
                 on_loop: Callable[[asyncio.AbstractEventLoop], None] | None = None) -> None:
        super().__init__(config)
        self._on_signal = on_signal
        self._on_loop = on_loop  # told uvicorn's loop at start-up (the engine's failures are posted to it)
        self._throughput = throughput  # ThroughputLog: its task runs on uvicorn's loop
        self._throughput_task: asyncio.Task | None = None

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
        if self._on_loop is not None:
            self._on_loop(asyncio.get_running_loop())
        if self.started and self.servers:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            shown = f"[{host}]" if ":" in host else host
            log.info("listening on http://%s:%d", shown, port)
            if self._throughput is not None:
                self._throughput_task = asyncio.get_running_loop().create_task(self._throughput.run())

    async def shutdown(self, sockets: Any = None) -> None:
        if self._throughput_task is not None:
            self._throughput_task.cancel()
        await super().shutdown(sockets)


def _report(model: str, exc: BaseException) -> int:
    """A start-up failure: one line and a hint for a user's mistake, the traceback for a bug."""
    described = describe_failure(exc)
    if described is None:
        log.error("cannot serve %s: an internal error (please report it)", model, exc_info=exc)
        return 1
    message, hint = described
    log.error("cannot serve %s: %s", model, message)
    if hint:
        log.error("hint: %s", hint)
    return 1


def _check_server_flags(args: argparse.Namespace) -> None:
    if args.max_logprobs < 0:
        raise StartupError(f"--max-logprobs must be 0 or more, not {args.max_logprobs}")
    if not args.log_stats_interval > 0:
        raise StartupError(f"--log-stats-interval must be positive, not {args.log_stats_interval}")
    if args.request_timeout is not None and not args.request_timeout > 0:
        raise StartupError(f"--request-timeout must be positive, not {args.request_timeout}")
    if not args.responses_store_ttl > 0:
        raise StartupError(f"--responses-store-ttl must be positive, not {args.responses_store_ttl}")
    template_defaults(args)


def _validate(config: EngineConfig) -> None:
    """``EngineConfig.validate`` with its field names said as the flags that set them."""
    try:
        config.validate()
    except ValueError as exc:
        fields = "|".join(f.name for f in dataclasses.fields(EngineConfig))
        message = re.sub(rf"\b({fields})\b(?!\.json)", lambda m: "--" + m.group(1).replace("_", "-"), str(exc))
        raise StartupError(message) from None


def _describe_thinking(args: argparse.Namespace, engine) -> str:
    """The start-up line on thinking: its default, the budget, and where unset sampling knobs come from."""
    default = "off by default" if template_defaults(args).get("enable_thinking") is False else "as the template defaults"
    budget = f"at most {args.max_thinking_budget} reasoning tokens" if args.max_thinking_budget is not None \
        else "no budget unless a request asks"
    modes = sorted(engine.arch.sampling_defaults) if engine.config.generation_config == "auto" else []
    source = {"auto": "generation_config.json", "vllm": "none (vLLM's defaults)"}.get(
        engine.config.generation_config, f"{engine.config.generation_config}/generation_config.json")
    extra = f", then {engine.arch.name}'s mode defaults ({', '.join(modes)})" if modes else ""
    return f"{default}, {budget}; sampling defaults: {source}{extra}"


def _cors(args: argparse.Namespace):
    from armillary.server.app import CORSSettings

    if args.allowed_origins is None:
        return None
    return CORSSettings(args.allowed_origins, args.allowed_methods, args.allowed_headers, args.allow_credentials)


def run_serve(args: argparse.Namespace) -> int:
    _setup_logging(args.log_level)
    model = args.model_option or args.model_positional or "the default model"
    from armillary.worker.ranks import launched_rank

    launched = launched_rank()
    if launched is not None and launched.rank > 0:  # under torchrun only rank 0 serves HTTP
        return _follow(args, launched.rank)
    try:  # everything a user can get wrong is found here, in a second, before anything loads
        _check_server_flags(args)
        sock = bind_listening_socket(args.host, args.port)
    except StartupError as exc:
        return _report(model, exc)
    try:
        return _serve(args, sock)
    finally:
        sock.close()


def _follow(args: argparse.Namespace, rank: int) -> int:
    """A launched rank above 0: its shard of the model, following rank 0's engine until rank 0 stops."""
    from armillary.worker.ranks import follow_rank_zero

    model = args.model_option or args.model_positional
    try:
        registry = default_registry()
        model = model or registry.hook.armillary_default_model()
        config = engine_config(args, model)
        _validate(config)
        log.info("rank %d: following rank 0 (it serves HTTP)", rank)
        follow_rank_zero(config, registry)
    except Exception as exc:
        return _report(f"{model or 'the default model'} (rank {rank})", exc)
    return 0


def _serve(args: argparse.Namespace, sock) -> int:
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
        config = engine_config(args, model)
        _validate(config)
        if config.chat_template is not None:
            from armillary.chat_template import load_chat_template

            load_chat_template(config.chat_template)  # a missing file or a broken template fails now
        check_parser_names(registry, args.tool_call_parser, args.reasoning_parser)
    except Exception as exc:
        return _report(model or "the default model", exc)
    plugins = ", ".join(f"{i.name} {i.version}".strip() + (f" ({', '.join(i.architectures)})" if i.architectures else "")
                        for i in registry.infos.values())
    log.info("plugins found: %s", plugins)
    if registry.broken:
        log.warning("broken plugins skipped: %s", ", ".join(registry.broken))
    if args.trust_remote_code:
        log.info("--trust-remote-code: accepted; armillary never runs code shipped with a checkpoint "
                 "(architectures come from installed plugins)")
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if api_key is None:
        log.warning("no API key set (--api-key or $%s): the server answers anyone who can reach %s:%d",
                    API_KEY_ENV, args.host, args.port)
    return _load_and_serve(args, model, config, registry, api_key, sock)


def _load_and_serve(args: argparse.Namespace, model: str, config: EngineConfig, registry: PluginRegistry,
                    api_key: str | None, sock) -> int:
    from armillary.engine import LLMEngine
    from armillary.server.app import build_app
    from armillary.server.async_engine import AsyncEngine
    from armillary.server.limits import RequestLimits
    from armillary.server.metrics import ServerMetrics, ThroughputLog
    from armillary.server.parsing import ParserSetup
    from armillary.server.responses_store import ResponseStore
    from armillary.server.state import ServerState
    from armillary.server.warm_requests import warm_routes

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
        parsers.check_auto_tool_choice(args.enable_auto_tool_choice)
        check_thinking_budget(parsers, args.max_thinking_budget)
    except KeyboardInterrupt:
        log.info("interrupted while loading")
        return 0
    except Exception as exc:
        engine.shutdown(timeout=5)
        return _report(model, exc)
    log.info("parsers: %s", parsers.describe())
    log.info("thinking: %s", _describe_thinking(args, loaded))
    state = ServerState(engine, list(args.served_model_name or [model]), parsers, metrics, api_key,
                        template_defaults(args), args.max_request_body_bytes,
                        max_logprobs=args.max_logprobs, enable_auto_tool_choice=args.enable_auto_tool_choice,
                        limits=RequestLimits(args.max_n, args.max_stop_strings, args.max_tools, args.max_schema_bytes,
                                             args.max_schema_depth, args.request_timeout),
                        responses=ResponseStore(args.responses_store_size, args.responses_store_ttl),
                        max_thinking_budget=args.max_thinking_budget)
    app = build_app(state, _cors(args))
    try:
        asyncio.run(warm_routes(state, app))  # the request path's first use, before the socket is served
    except KeyboardInterrupt:
        engine.shutdown(timeout=5)
        log.info("interrupted while warming up")
        return 0
    if engine.dead is not None:
        engine.shutdown(timeout=5)
        log.error("exiting with status %d: the engine failed during warm-up (%s)", ENGINE_FAILED_EXIT, engine.dead)
        return ENGINE_FAILED_EXIT
    throughput = None if args.disable_log_stats else ThroughputLog(metrics, args.log_stats_interval)
    server = _Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                    timeout_graceful_shutdown=10), on_signal=engine.begin_shutdown,
                     throughput=throughput, on_loop=engine.bind_loop)  # a rank dying before any request exits too
    engine.on_dead = lambda exc: _exit_on_dead_engine(server, exc)
    try:
        server.run(sockets=[sock])
    except SystemExit as exc:  # uvicorn exits when it cannot serve
        engine.shutdown(timeout=5)
        return int(exc.code or 1)
    engine.shutdown(timeout=10)
    if engine.dead is not None:
        log.error("exiting with status %d: the engine failed (%s)", ENGINE_FAILED_EXIT, engine.dead)
        return ENGINE_FAILED_EXIT
    log.info("stopped")
    return 0


ENGINE_FAILED_EXIT = 3  # a step raised: the process exits so that a supervisor restarts it
_DEAD_ENGINE_LINGER_S = 1.0  # /health answers 503 this long, so probes see why before the port closes
_DEAD_ENGINE_GRACE_S = 6.0  # then the process goes regardless, however shutdown is going


def _exit_on_dead_engine(server: uvicorn.Server, exc: BaseException) -> None:
    """Fail fast: health answers 503 already; stop serving a moment later and never outlive the grace period."""
    log.error("the engine failed (%s: %s); exiting in %.0f s", type(exc).__name__, exc, _DEAD_ENGINE_LINGER_S)
    asyncio.get_running_loop().call_later(_DEAD_ENGINE_LINGER_S, setattr, server, "should_exit", True)

    def force() -> None:
        log.error("shutdown took over %.0f s; exiting with status %d", _DEAD_ENGINE_GRACE_S, ENGINE_FAILED_EXIT)
        logging.shutdown()
        os._exit(ENGINE_FAILED_EXIT)

    timer = threading.Timer(_DEAD_ENGINE_GRACE_S, force)
    timer.daemon = True
    timer.start()
