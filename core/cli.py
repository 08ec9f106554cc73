"""The ``armillary`` command: ``plugins`` lists what is installed, ``serve`` runs the HTTP server."""
from __future__ import annotations

import argparse
import sys

from armillary import __version__
from armillary.registry import DISABLE_ENV, default_registry


def cmd_plugins(args: argparse.Namespace) -> int:
    reg = default_registry()
    for info in reg.infos.values():
        print(f"{info.name}  ({info.distribution} {info.version})".rstrip())
        for name in info.architectures:
            spec = reg.architectures.get(name)
            print(f"  architecture {name}: {', '.join(spec.hf_architectures)}")
        for name in info.parsers:
            print(f"  parser {name} ({reg.parsers.get(name).kind})")
        for name in info.kernels:
            print(f"  kernel {_kernel_line(reg.kernels.get(name))}")
        for name in info.formats:
            print(f"  model format {name}")
        for name in info.quantizations:
            print(f"  quantization {name}")
    for broken in reg.broken.values():  # skipped, not fatal: the others still serve
        print(f"{broken.name}  ({broken.distribution} {broken.version})".rstrip() + "  BROKEN, skipped")
        print(f"  entry point {broken.entry_point}")
        print(f"  error: {broken.error}")
        print(f"  disable it with {DISABLE_ENV}={broken.name}")
    _print_dispatch(reg)
    return 0


def _kernel_line(spec) -> str:
    targets = ", ".join(f"sm_{a}{b}" for a, b in spec.targets) or "any device"
    archs = f", architectures {', '.join(spec.architectures)}" if spec.architectures else ""
    return f"{spec.name}: {spec.interface} ({spec.kind}, priority {spec.priority}{archs}) [{targets}]"


def _print_dispatch(reg) -> None:
    """The dispatch table this machine resolves (backend auto), and what each architecture changes in it."""
    import torch

    from armillary.kernels.dispatch import resolve_dispatch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        generic = resolve_dispatch(reg, None, device)
        print(f"kernel dispatch for {generic.header()}")
        for line in generic.describe():
            print(f"  {line}")
        base = dict(zip(generic.chains, generic.describe()))
        for arch in reg.architectures:
            table = resolve_dispatch(reg, arch.name, device)
            changed = [line for name, line in zip(table.chains, table.describe()) if base.get(name) != line]
            if changed or table.tuning_packages:
                tables = " over ".join((*table.tuning_packages, "core"))
                print(f"  for {arch.name} (tuning tables {tables}): {'; '.join(changed) or 'same kernels'}")
    except Exception as exc:  # a broken lazy reference must not hide the listing above
        print(f"kernel dispatch failed: {type(exc).__name__}: {exc}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="armillary", description="LLM inference server with architecture plugins")
    parser.add_argument("--version", action="version", version=f"armillary {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("plugins", help="list installed plugins with their architectures, parsers and kernels")
    serve = sub.add_parser("serve", help="serve a model over the OpenAI and Anthropic APIs")
    try:
        from armillary.server.cli import add_serve_args, run_serve
    except ImportError as exc:  # a broken install: say so for any flags given, never "unrecognized arguments"
        serve.set_defaults(serve_error=f"{exc}; the server's packages are armillary's own dependencies, so this "
                                       f"install is incomplete: reinstall it (pip install --force-reinstall armillary)")
    else:
        add_serve_args(serve)
        serve.set_defaults(run=run_serve)
    args, unknown = parser.parse_known_args(argv)
    if getattr(args, "serve_error", None):  # whatever flags were given: they could not be known
        print(f"armillary serve is unavailable: {args.serve_error}", file=sys.stderr)
        return 1
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "plugins":
        return cmd_plugins(args)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
