"""The ``exactspec`` command line: ``generate``, ``bench``, ``audit``, ``serve`` and
``train-draft``; each ``exactspec COMMAND --help`` explains every option."""

from __future__ import annotations

import argparse
import sys

from exactspec import __version__
from exactspec.cli import audit, bench, generate, serve, train_draft
from exactspec.cli.common import EXIT_INTERRUPTED, EXIT_STATUSES

COMMANDS = {"generate": generate, "bench": bench, "audit": audit, "serve": serve,
            "train-draft": train_draft}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="exactspec",
        description="Exact speculative decoding: faster generation, the target model's output "
                    "distribution unchanged.", epilog=EXIT_STATUSES)
    parser.add_argument("--version", action="version", version=f"exactspec {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS.values():
        module.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit status (see :data:`EXIT_STATUSES`), 130 after
    Ctrl-C (one line on stderr, no traceback). Bad arguments exit with status 2 through
    argparse (``SystemExit``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command].run(args, args.subparser)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
