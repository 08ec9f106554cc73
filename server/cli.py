"""``armillary serve``: flags, start-up (one log line per stage), uvicorn, graceful shutdown."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
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
from armillary.errors import ArmillaryError
from armillary.registry import PluginRegistry, default_registry
from armillary.server.startup_checks import (
    StartupError,
    bind_listening_socket,
    check_parser_names,
    describe_failure,
    string_list,
)

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
    ("chat_template", str, "a .jinja file or the template text: replaces the checkpoint's chat template"),
    ("generation_config", str, "auto: sampling defaults from the checkpoint's generation_config.json; "
                               "vllm: none; or a folder holding a generation_config.json"),
    ("state_checkpoint_interval", int, "with prefix caching on a hybrid model: snapshot recurrent states every "
                                       "this many prompt tokens (a multiple of --block-size)"),
    ("num_state_snapshots", int, "recurrent-state snapshot rows (default with prefix caching: a tenth of the "
                                 "cache budget)"),
    ("num_drafts", int, "with --speculative: draft tokens per step (1-3)"),
    ("quantization", str, "fp8: quantize a bf16 checkpoint at load time (default: the checkpoint's own format)"),
    ("kv_cache_dtype", str, "auto (the model dtype) or fp8 (e4m3 with per-layer scales)"),
    ("kv_high_precision_layers", str, "with an fp8 KV cache: auto (first and last attention layer), N, or i,j,..."),
    ("fp8_kv_calibration_tokens", int, "with an fp8 KV cache and no checkpoint scales: calibrate over this many tokens"),
    ("download_dir", str, "the Hugging Face cache folder to find repo ids in (default: HF_HUB_CACHE / HF_HOME)"),
)

_FLAG_ALIASES = {"state_checkpoint_interval": ("--ssm-checkpoint-interval",)}  # Atlas's name


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


def _string_list(text: str) -> list[str]:
    try:
        return string_list(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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
    net.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                     help="a request still generating after this long ends with 408 (default: no limit)")
    net.add_argument("--max-n", type=_positive_int, default=128, help="the most choices (n) one request may ask for")
    net.add_argument("--max-stop-strings", type=_positive_int, default=16, help="the most stop strings per request")
    net.add_argument("--max-tools", type=_positive_int, default=128, help="the most tools per request")
    net.add_argument("--max-schema-bytes", type=_positive_int, default=64 * 1024,
                     help="the largest JSON schema (tool parameters, output format) in bytes")
    net.add_argument("--max-schema-depth", type=_positive_int, default=32,
                     help="the deepest nesting of a JSON schema (tool parameters, output format)")
    net.add_argument("--responses-store-size", type=_positive_int, default=1024,
                     help="Responses API: the most stored responses (oldest dropped first)")
    net.add_argument("--responses-store-ttl", type=float, default=3600.0, metavar="SECONDS",
                     help="Responses API: seconds a stored response is kept")
    net.add_argument("--tool-call-parser", help="tool-call parser name, or 'none' (default: the model's)")
    net.add_argument("--reasoning-parser", help="reasoning parser name, or 'none' (default: the model's)")
    net.add_argument("--default-chat-template-kwargs", type=_json_object, default={},
                     help='JSON object of chat template variables, e.g. \'{"enable_thinking": false}\'')
    net.add_argument("--enable-auto-tool-choice", action="store_true",
                     help="accepted as in vLLM: the model may call tools on its own (tool_choice auto)")
    net.add_argument("--max-logprobs", type=int, default=20,
                     help="the most logprobs / top_logprobs a request may ask for")
    net.add_argument("--trust-remote-code", action="store_true",
                     help="accepted for vLLM compatibility; armillary never runs code shipped with a checkpoint")
    net.add_argument("--allowed-origins", type=_string_list, metavar="ORIGINS",
                     help='CORS: origins browsers may call from, JSON list or comma-separated (e.g. \'["*"]\'); '
                          "default: no CORS headers")
    net.add_argument("--allowed-methods", type=_string_list, default=["*"], metavar="METHODS",
                     help="CORS: allowed methods (default: all)")
    net.add_argument("--allowed-headers", type=_string_list, default=["*"], metavar="HEADERS",
                     help="CORS: allowed request headers (default: all)")
    net.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    net.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    net.add_argument("--disable-log-stats", action="store_true", help="no throughput line while busy")
    net.add_argument("--log-stats-interval", type=float, default=10.0, metavar="SECONDS",
                     help="seconds between throughput lines while busy")
    eng = parser.add_argument_group("engine")
    for dest, kind, help_text in _ENGINE_FLAGS:
        names = ["--" + dest.replace("_", "-"), *_FLAG_ALIASES.get(dest, ())]
        eng.add_argument(*names, dest=dest, type=kind, help=help_text)
    eng.add_argument("--enforce-eager", action="store_true", default=None, help="no CUDA graphs")
    eng.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                     help="launch the next decode step before reading the last one's tokens (default: on CUDA)")
    eng.add_argument("--speculative", action="store_true", default=None,
                     help="speculative decoding with the checkpoint's MTP head (Atlas's flag)")
    eng.add_argument("--speculative-config", type=_json_object, default=None,
                     help='vLLM\'s form, e.g. \'{"method": "mtp", "num_speculative_tokens": 2}\'')
    eng.add_argument("--enable-prefix-caching", action="store_true", default=None,
                     help="reuse the KV blocks (and, on hybrid models, recurrent-state snapshots) of prompt "
                          "prefixes seen before; output is unchanged")
    before = {action.dest for action in parser._actions}
    try:
        impls = (registry or default_registry()).hook.armillary_add_cli_args.get_hookimpls()
    except ArmillaryError as exc:  # a broken plugin must not break --help; serving reports it again
        log.warning("plugin flags unavailable: %s", exc)
        impls = []
    for impl in impls:
        try:
            impl.function(parser=parser)
        except Exception as exc:  # one plugin's flags failing must not hide the others' (or --help)
            log.warning("plugin %r could not add its flags: %s: %s", impl.plugin_name, type(exc).__name__, exc)
    parser.set_defaults(plugin_arg_names=sorted({action.dest for action in parser._actions} - before))


_DRAFT_METHODS = ("mtp", "qwen3_next_mtp", "qwen3_5_mtp", "deepseek_mtp", "glm4_moe_mtp")  # vLLM's names


def _speculative_config(spec: dict | None) -> dict:
    """vLLM's ``--speculative-config`` as armillary's fields (only the model's own MTP head drafts)."""
    if not spec:
        return {}
    method = spec.get("method", "mtp")
    if method not in _DRAFT_METHODS:
        raise ValueError(f"speculative method {method!r} is not supported; armillary drafts with the checkpoint's "
                         f"MTP head: {', '.join(_DRAFT_METHODS)}")
    unknown = set(spec) - {"method", "num_speculative_tokens", "model"}
    if unknown:
        raise ValueError(f"unsupported --speculative-config keys: {', '.join(sorted(unknown))}")
    return {"speculative": True, "num_drafts": spec.get("num_speculative_tokens", 2)}


def engine_config(args: argparse.Namespace, model: str) -> EngineConfig:
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    values = {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
    values["model"] = model
    values.update(_speculative_config(getattr(args, "speculative_config", None)))
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

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[], None], throughput: Any = None) -> None:
        super().__init__(config)
        self._on_signal = on_signal
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


def _validate(config: EngineConfig) -> None:
    """``EngineConfig.validate`` with its field names said as the flags that set them."""
    try:
        config.validate()
    except ValueError as exc:
        fields = "|".join(f.name for f in dataclasses.fields(EngineConfig))
        message = re.sub(rf"\b({fields})\b(?!\.json)", lambda m: "--" + m.group(1).replace("_", "-"), str(exc))
        raise StartupError(message) from None


def _cors(args: argparse.Namespace):
    from armillary.server.app import CORSSettings

    if args.allowed_origins is None:
        return None
    return CORSSettings(args.allowed_origins, args.allowed_methods, args.allowed_headers, args.allow_credentials)


def run_serve(args: argparse.Namespace) -> int:
    _setup_logging(args.log_level)
    model = args.model_option or args.model_positional or "the default model"
    try:  # everything a user can get wrong is found here, in a second, before anything loads
        _check_server_flags(args)
        sock = bind_listening_socket(args.host, args.port)
    except StartupError as exc:
        return _report(model, exc)
    try:
        return _serve(args, sock)
    finally:
        sock.close()


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
    except KeyboardInterrupt:
        log.info("interrupted while loading")
        return 0
    except Exception as exc:
        engine.shutdown(timeout=5)
        return _report(model, exc)
    log.info("parsers: %s", parsers.describe())
    state = ServerState(engine, list(args.served_model_name or [model]), parsers, metrics, api_key,
                        dict(args.default_chat_template_kwargs), args.max_request_body_bytes,
                        max_logprobs=args.max_logprobs, enable_auto_tool_choice=args.enable_auto_tool_choice,
                        limits=RequestLimits(args.max_n, args.max_stop_strings, args.max_tools, args.max_schema_bytes,
                                             args.max_schema_depth, args.request_timeout),
                        responses=ResponseStore(args.responses_store_size, args.responses_store_ttl))
    app = build_app(state, _cors(args))
    throughput = None if args.disable_log_stats else ThroughputLog(metrics, args.log_stats_interval)
    server = _Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                    timeout_graceful_shutdown=10), on_signal=engine.begin_shutdown,
                     throughput=throughput)
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
