"""The ``armillary`` command: ``plugins`` lists what is installed, ``serve`` runs the HTTP server."""
from __future__ import annotations

import argparse
import sys

from armillary.registry import default_registry


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
            spec = reg.kernels.get(name)
            targets = ", ".join(f"sm_{a}{b}" for a, b in spec.targets) or "any device"
            print(f"  kernel {name}: {spec.interface} [{targets}]")
        for name in info.formats:
            print(f"  model format {name}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="armillary", description="LLM inference server with architecture plugins")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("plugins", help="list installed plugins with their architectures, parsers and kernels")
    serve = sub.add_parser("serve", help="serve a model over the OpenAI and Anthropic APIs")
    try:
        from armillary.server.cli import add_serve_args, run_serve
    except ImportError as exc:  # the server's dependencies are optional for the offline API
        serve.set_defaults(serve_error=str(exc))
    else:
        add_serve_args(serve)
        serve.set_defaults(run=run_serve)
    args = parser.parse_args(argv)
    if args.command == "plugins":
        return cmd_plugins(args)
    if getattr(args, "serve_error", None):
        print(f"armillary serve is unavailable: {args.serve_error}", file=sys.stderr)
        return 1
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
