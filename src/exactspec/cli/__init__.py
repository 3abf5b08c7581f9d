"""The ``exactspec`` command line: ``generate``, ``bench``, ``audit``, ``serve`` and
``train-draft``; each ``exactspec COMMAND --help`` explains every option.

Dispatch is lazy: only the chosen command's module is imported (``exactspec --help`` lists
the commands from :data:`COMMANDS` alone), and a command's module imports PyTorch and its
tool's extra only when it runs, so ``--help`` starts at once."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from rich.console import Console

from exactspec import __version__
from exactspec.cli.common import EXIT_INTERRUPTED, EXIT_STATUSES, print_error
from exactspec.extras import EXTRAS, MissingExtraError, missing_message

COMMANDS = {
    "generate": ("exactspec.cli.generate", "generate text with speculative decoding"),
    "bench": ("exactspec.cli.bench",
              "measure speedup per task group, side by side with peer engines"),
    "audit": ("exactspec.cli.audit",
              "test that speculative decoding keeps the target's distribution exactly"),
    "serve": ("exactspec.cli.serve", "serve the model over an OpenAI-compatible HTTP API"),
    "train-draft": ("exactspec.cli.train_draft",
                    "train a draft head (EAGLE family) for --proposer head:PATH"),
}
"""Command → (its module, its one-line help). Each module has ``add_parser(commands)`` and
``run(args, parser)``."""
COMMAND_EXTRAS = {"serve": "server", "audit": "audit", "bench": "bench",
                  "train-draft": "plots", "generate": "plots"}
"""The extra that holds what each command may lack (``generate``: only ``--trace``)."""


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser: with ``argv``, the full options of the command it names only (the others
    listed by name); without, every command's.

    Raises:
        MissingExtraError: if the command's module needs an extra that is not installed.
    """
    parser = argparse.ArgumentParser(
        prog="exactspec",
        description="Exact speculative decoding: faster generation, the target model's output "
                    "distribution unchanged.", epilog=EXIT_STATUSES)
    parser.add_argument("--version", action="version", version=f"exactspec {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = None if argv is None else next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help) in COMMANDS.items():
        if argv is None or name == chosen:
            importlib.import_module(module).add_parser(commands)
        else:
            commands.add_parser(name, help=help)
    return parser


DEBUG_VARIABLE = "EXACTSPEC_DEBUG"
"""Set to 1 to see an unexpected error's traceback instead of its one line."""


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit status (see :data:`EXIT_STATUSES`), 130 after
    Ctrl-C (one line on stderr, no traceback). Bad arguments exit with status 2 through
    argparse (``SystemExit``); a command whose extra is missing exits with status 1 and
    the line naming it (:class:`~exactspec.extras.MissingExtraError`); any other error
    exits with status 1 and one line naming its type and message (the traceback with
    ``EXACTSPEC_DEBUG=1``)."""
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    try:
        parser = build_parser(argv)
        args = parser.parse_args(argv)
        return importlib.import_module(COMMANDS[args.command][0]).run(args, args.subparser)
    except MissingExtraError as error:
        print_error(Console(stderr=True, soft_wrap=True), error)
        return 1
    except ModuleNotFoundError as error:  # one a tool imports without checking its extra
        extra = _extra_providing((error.name or "").partition(".")[0], command)
        if extra is None:
            raise
        print_error(Console(stderr=True, soft_wrap=True),
                    MissingExtraError(missing_message(f"exactspec {command}",
                                                      error.name.partition(".")[0], extra)))
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as error:  # noqa: BLE001 (any other error: one line, not a traceback)
        if os.environ.get(DEBUG_VARIABLE, "0") not in ("", "0"):
            raise
        print_error(Console(stderr=True, soft_wrap=True),
                    f"{type(error).__name__}: {error} ({DEBUG_VARIABLE}=1 shows the traceback)")
        return 1


def _extra_providing(module: str, command: str | None) -> str | None:
    """The extra that installs ``module``: the command's own when it lists it, else the
    first that does (None: no extra does)."""
    extras = [COMMAND_EXTRAS.get(command)] + sorted(EXTRAS)
    return next((extra for extra in extras if extra and module in EXTRAS[extra]), None)


if __name__ == "__main__":
    sys.exit(main())
