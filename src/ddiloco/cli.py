"""The ``ddiloco`` command: one subcommand per module in :mod:`ddiloco.commands`.

Each command module holds ``HELP`` (its line in ``ddiloco --help``) and ``add_parser(subparsers)``,
which registers its parser and sets ``func`` (``func(args) -> int``) as the parser default. User
mistakes surface as one line ``ddiloco: error: ...`` and exit code 2, never as a traceback.

Fast start: a command module imports at its top only what its parser needs without torch;
torch, the model, the gRPC service and numba are imported by the functions that use them, and
only the chosen command's parser is built (its ``add_parser`` may read the configuration, which
needs torch). So ``ddiloco --version``, ``ddiloco --help`` and ``ddiloco status`` start in a
fraction of a second (tests/commands/test_cli_fast.py keeps it so).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Collection
from types import ModuleType
from typing import NoReturn, Sequence

from ddiloco import __version__
from ddiloco.commands import (
    bandwidth,
    chaos,
    compare,
    export,
    fingerprint,
    goodput,
    launch,
    learner,
    run,
    simtest,
    status,
    sync,
)
from ddiloco.commands import eval as eval_command
from ddiloco.core.shared.errors import DdilocoError

COMMANDS: tuple[ModuleType, ...] = (run, compare, simtest, fingerprint, goodput, bandwidth, sync, learner, status,
                                    chaos, export, eval_command, launch)
"""In the order ``ddiloco --help`` lists them."""
NAMES = tuple(m.__name__.rsplit(".", 1)[1] for m in COMMANDS)


class OneLineParser(argparse.ArgumentParser):
    """argparse prints usage plus an error; we print only the error, on one line."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"ddiloco: error: {message}\n")


def build_parser(full: Collection[str] = NAMES) -> argparse.ArgumentParser:
    """The parser; the commands in ``full`` with all their options, the others as their help line
    (``main`` builds only the command it runs: the others' options may need torch to describe)."""
    parser = OneLineParser(
        prog="ddiloco",
        description="Decoupled DiLoCo: resilient, asynchronous, low-bandwidth distributed pre-training.",
    )
    parser.add_argument("--version", action="version", version=f"ddiloco {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    sub.required = True
    for name, module in zip(NAMES, COMMANDS):
        if name in full:
            module.add_parser(sub)
        else:
            sub.add_parser(name, help=module.HELP)
    return parser


def chosen_command(argv: Sequence[str]) -> str | None:
    """The command ``argv`` runs: its first word that is not an option (``ddiloco`` itself takes no value)."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = chosen_command(argv)
    args = build_parser(full=(command,) if command in NAMES else ()).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except DdilocoError as err:
        print(f"ddiloco: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ddiloco: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
