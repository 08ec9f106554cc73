"""The flags of ``armillary serve``, grouped as ``--help`` shows them, under vLLM's names with Atlas's as aliases.

Engine flags default to None so that ``EngineConfig`` keeps its own defaults; ``engine_config``
turns the parsed flags into an ``EngineConfig``. A combination of flags not built yet is refused by
``EngineConfig.validate`` naming its issue, never ignored.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging

from armillary.config import SCHEDULING_POLICIES, EngineConfig
from armillary.errors import ArmillaryError
from armillary.registry import PluginRegistry, default_registry
from armillary.server.startup_checks import StartupError, string_list

log = logging.getLogger("armillary.server")

API_KEY_ENV = "ARMILLARY_API_KEY"

# (EngineConfig field, type, help, Atlas / vLLM aliases) per help group, in --help order
_ENGINE_GROUPS: tuple[tuple[str, tuple[tuple[str, type, str, tuple[str, ...]], ...]], ...] = (
    ("model and device", (
        ("tokenizer", str, "tokenizer directory or repo id (default: the model's)", ()),
        ("revision", str, "Hugging Face revision of the model", ()),
        ("download_dir", str, "the Hugging Face cache folder to find repo ids in (default: HF_HUB_CACHE / HF_HOME)",
         ()),
        ("dtype", str, "weights and activations dtype: auto, bfloat16, float16, float32", ()),
        ("device", str, "auto, cuda, cuda:N or cpu", ()),
        ("load_format", str, "auto, or dummy for random weights", ()),
        ("kernel_backend", str, "auto (Triton on CUDA), reference (plain torch everywhere) or triton", ()),
        ("max_graph_batch", int, "largest decode batch captured in a CUDA graph", ()),
        ("seed", int, "engine random seed", ()),
    )),
    ("memory and scheduling", (
        ("max_model_len", int, "context length limit (default: the checkpoint's)", ("--max-seq-len",)),
        ("max_num_seqs", int, "most sequences running at once", ()),
        ("max_num_batched_tokens", int, "token budget of one step (decodes plus prefill chunks; default by device: "
                                      "16384 on GPUs of 70 GiB or more, 8192 on smaller ones, 2048 on the CPU)",
         ("--max-prefill-tokens",)),
        ("tbt_deadline_ms", float, "with --scheduling-policy slai: the inter-token latency (ms) running streams "
                                   "are kept under", ()),
        ("block_size", int, "tokens per paged KV block", ()),
        ("gpu_memory_utilization", float, "fraction of GPU memory the engine may use", ()),
        ("cpu_kv_cache_space_gb", float, "KV and state cache budget in GiB when running on the CPU", ()),
        ("num_kv_blocks", int, "override the memory planner's KV block count", ()),
    )),
    ("prefix caching", (
        ("state_checkpoint_interval", int, "with prefix caching on a hybrid model: snapshot recurrent states every "
                                           "this many prompt tokens (a multiple of --block-size)",
         ("--ssm-checkpoint-interval",)),
        ("num_state_snapshots", int, "recurrent-state snapshot rows (default with prefix caching: a tenth of the "
                                     "cache budget)", ()),
    )),
    ("speculative decoding", (
        ("num_drafts", int, "with --speculative: draft tokens per step (1-3)", ()),
    )),
    ("quantization", (
        ("quantization", str, "fp8: quantize a bf16 checkpoint at load time (default: the checkpoint's own format)",
         ()),
        ("kv_cache_dtype", str, "auto (the model dtype) or fp8 (e4m3 with per-layer scales)", ()),
        ("kv_high_precision_layers", str, "with an fp8 KV cache: auto (first and last attention layer), N, or "
                                          "i,j,...", ()),
        ("fp8_kv_calibration_tokens", int, "with an fp8 KV cache and no checkpoint scales: calibrate over this many "
                                           "tokens", ()),
    )),
    ("chat, tools and reasoning", (
        ("chat_template", str, "a .jinja file or the template text: replaces the checkpoint's chat template", ()),
        ("generation_config", str, "auto: sampling defaults from the checkpoint's generation_config.json (and the "
                                   "model's mode defaults); vllm: none; or a folder holding a generation_config.json",
         ()),
    )),
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


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
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
    _server_flags(parser)
    _limit_flags(parser)
    groups = {}
    for title, flags in _ENGINE_GROUPS:
        group = groups[title] = parser.add_argument_group(title)
        for dest, kind, help_text, aliases in flags:
            group.add_argument("--" + dest.replace("_", "-"), *aliases, dest=dest, type=kind, help=help_text)
    _engine_switches(groups)
    _chat_flags(groups["chat, tools and reasoning"])
    par = parser.add_argument_group("parallelism")
    par.add_argument("--tensor-parallel-size", "--tp-size", "-tp", dest="tensor_parallel_size", type=_positive_int,
                     default=1, help="ranks one model is split over, one process each (GPUs, or CPU processes over "
                     "gloo); models whose plugin shards its layers (every bundled one: llama, gemma, qwen_gdn_moe, "
                     "nemotron, glm_flash)")
    par.add_argument("--expert-parallel-size", "--ep-size", dest="expert_parallel_size", type=_positive_int,
                     default=1, help="ranks the MoE experts are split over, whole: the tensor-parallel size (the same "
                     "ranks), or any with --tp-size 1")
    par.add_argument("--distributed-timeout-s", dest="distributed_timeout_s", type=float, default=None,
                     help="with several ranks: how long a collective or a rank's reply may take before the server "
                          "stops with an error naming the rank (default 120)")
    _plugin_flags(parser, registry)


def _server_flags(parser: argparse.ArgumentParser) -> None:
    net = parser.add_argument_group("server")
    net.add_argument("--host", "--bind", dest="host", default="127.0.0.1",
                     help="address to listen on (0.0.0.0: every interface)")
    net.add_argument("--port", type=int, default=8888, help="0 picks a free port (logged at start-up)")
    net.add_argument("--served-model-name", "--model-name", dest="served_model_name", nargs="+", metavar="NAME",
                     help="names clients use (default: MODEL as given)")
    net.add_argument("--api-key", help=f"require this key (also ${API_KEY_ENV}); without one the server is open")
    net.add_argument("--trust-remote-code", action="store_true",
                     help="accepted for vLLM compatibility; armillary never runs code shipped with a checkpoint")
    net.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    net.add_argument("--disable-log-stats", action="store_true", help="no throughput line while busy")
    net.add_argument("--log-stats-interval", type=float, default=10.0, metavar="SECONDS",
                     help="seconds between throughput lines while busy")
    cors = parser.add_argument_group("CORS")
    cors.add_argument("--allowed-origins", type=_string_list, metavar="ORIGINS",
                      help='origins browsers may call from, JSON list or comma-separated (e.g. \'["*"]\'); '
                           "default: no CORS headers")
    cors.add_argument("--allowed-methods", type=_string_list, default=["*"], metavar="METHODS",
                      help="allowed methods (default: all)")
    cors.add_argument("--allowed-headers", type=_string_list, default=["*"], metavar="HEADERS",
                      help="allowed request headers (default: all)")
    cors.add_argument("--allow-credentials", action="store_true", help="allow credentials")


def _limit_flags(parser: argparse.ArgumentParser) -> None:
    lim = parser.add_argument_group("request limits")
    lim.add_argument("--max-queue-size", type=_positive_int,
                     help="most requests waiting for their first token; more get 503 with Retry-After")
    lim.add_argument("--max-request-body-bytes", type=_positive_int, default=32 * 1024 * 1024,
                     help="larger request bodies get 413")
    lim.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                     help="a request still generating after this long ends with 408 (default: no limit)")
    lim.add_argument("--max-n", type=_positive_int, default=128, help="the most choices (n) one request may ask for")
    lim.add_argument("--max-stop-strings", type=_positive_int, default=16, help="the most stop strings per request")
    lim.add_argument("--max-tools", type=_positive_int, default=128, help="the most tools per request")
    lim.add_argument("--max-schema-bytes", type=_positive_int, default=64 * 1024,
                     help="the largest JSON schema (tool parameters, output format) in bytes")
    lim.add_argument("--max-schema-depth", type=_positive_int, default=32,
                     help="the deepest nesting of a JSON schema (tool parameters, output format)")
    lim.add_argument("--max-logprobs", type=int, default=20,
                     help="the most logprobs / top_logprobs a request may ask for")
    lim.add_argument("--responses-store-size", type=_positive_int, default=1024,
                     help="Responses API: the most stored responses (oldest dropped first)")
    lim.add_argument("--responses-store-ttl", type=float, default=3600.0, metavar="SECONDS",
                     help="Responses API: seconds a stored response is kept")


def _engine_switches(groups: dict[str, argparse._ArgumentGroup]) -> None:
    dev = groups["model and device"]
    dev.add_argument("--enforce-eager", action="store_true", default=None, help="no CUDA graphs")
    dev.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                     help="launch the next decode step before reading the last one's tokens (default: on CUDA)")
    groups["memory and scheduling"].add_argument(
        "--scheduling-policy", choices=SCHEDULING_POLICIES, default=None,
        help="fcfs (default): first come, first served; slai: prefill chunks sized so running streams keep their "
             "inter-token latency under --tbt-deadline-ms, short prompts before long ones")
    spec = groups["speculative decoding"]
    spec.add_argument("--speculative", action="store_true", default=None,
                      help="speculative decoding with the checkpoint's MTP head (Atlas's flag)")
    spec.add_argument("--speculative-config", type=_json_object, default=None,
                      help='vLLM\'s form, e.g. \'{"method": "mtp", "num_speculative_tokens": 2}\'')
    groups["prefix caching"].add_argument(
        "--enable-prefix-caching", action="store_true", default=None,
        help="reuse the KV blocks (and, on hybrid models, recurrent-state snapshots) of prompt prefixes seen "
             "before; output is unchanged")


def _chat_flags(chat: argparse._ArgumentGroup) -> None:
    chat.add_argument("--tool-call-parser", help="tool-call parser name, or 'none' (default: the model's)")
    chat.add_argument("--reasoning-parser", help="reasoning parser name, or 'none' (default: the model's)")
    chat.add_argument("--enable-auto-tool-choice", action="store_true",
                      help="accepted as in vLLM: the model may call tools on its own (tool_choice auto)")
    chat.add_argument("--default-chat-template-kwargs", type=_json_object, default={},
                      help='JSON object of chat template variables, e.g. \'{"enable_thinking": false}\'')
    chat.add_argument("--disable-thinking", action="store_true",
                      help="thinking off unless a request turns it on (the template variable enable_thinking=false)")
    chat.add_argument("--max-thinking-budget", type=_non_negative_int, default=None, metavar="N",
                      help="after N reasoning tokens the end of thinking is forced (Atlas's max_thinking_budget); "
                           "requests may ask for less (chat_template_kwargs.thinking_budget, reasoning_effort, "
                           "Anthropic thinking.budget_tokens)")


def _plugin_flags(parser: argparse.ArgumentParser, registry: PluginRegistry | None) -> None:
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


def template_defaults(args: argparse.Namespace) -> dict:
    """``--default-chat-template-kwargs`` with ``--disable-thinking`` (``enable_thinking: false``) under it."""
    kwargs = dict(args.default_chat_template_kwargs)
    if getattr(args, "disable_thinking", False):
        if kwargs.get("enable_thinking") is True:
            raise StartupError("--disable-thinking contradicts --default-chat-template-kwargs "
                               "'{\"enable_thinking\": true}'; give one")
        kwargs["enable_thinking"] = False
    return kwargs


def check_thinking_budget(parsers, budget: int | None) -> None:
    """``--max-thinking-budget`` needs a reasoning parser whose end tag can be forced."""
    if budget is None:
        return
    if parsers.reasoning_cls is None:
        raise StartupError("--max-thinking-budget needs a reasoning parser, and this model has none: add "
                           "--reasoning-parser NAME")
    if not getattr(parsers.reasoning_cls, "end_tag", None):
        raise StartupError(f"--max-thinking-budget: the {parsers.reasoning_name} reasoning parser has no end tag to "
                           "force")


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
