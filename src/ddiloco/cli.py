"""The ``ddiloco`` command: one subcommand per module in :mod:`ddiloco.commands`.

Each command module exposes ``add_parser(subparsers)``, which registers its parser and sets
``func`` (``func(args) -> int``) as the parser default. User mistakes surface as one line
``ddiloco: error: ...`` and exit code 2, never as a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NoReturn, Sequence

from ddiloco import __version__
from ddiloco.errors import DdilocoError

COMMAND_MODULES = ("run", "compare", "simtest", "goodput", "bandwidth", "sync", "learner", "status", "chaos",
                   "export", "launch")


class OneLineParser(argparse.ArgumentParser):
    """argparse prints usage plus an error; we print only the error, on one line."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"ddiloco: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="ddiloco",
        description="Decoupled DiLoCo: resilient, asynchronous, low-bandwidth distributed pre-training.",
    )
    parser.add_argument("--version", action="version", version=f"ddiloco {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    sub.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(f"ddiloco.commands.{name}").add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
