"""The ``exactspec`` command line: ``generate``, ``bench`` and ``audit``; each
``exactspec COMMAND --help`` explains every option."""

from __future__ import annotations

import argparse
import sys

from exactspec import __version__
from exactspec.cli import audit, bench, generate

COMMANDS = {"generate": generate, "bench": bench, "audit": audit}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="exactspec",
        description="Exact speculative decoding: faster generation, the target model's output "
                    "distribution unchanged.")
    parser.add_argument("--version", action="version", version=f"exactspec {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS.values():
        module.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return COMMANDS[args.command].run(args, args.subparser)


if __name__ == "__main__":
    sys.exit(main())
