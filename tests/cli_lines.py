"""Command lines written outside the code (docs, scripts, manifests) checked against the CLI's parser."""

from __future__ import annotations

import argparse
import functools
import shlex
from pathlib import Path

from ddiloco.cli import build_parser


@functools.cache
def _parser() -> argparse.ArgumentParser:
    return build_parser()


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    return action.choices


def check_command(argv: list[str]) -> argparse.Namespace:
    """``ddiloco`` arguments (without the program name), parsed; AssertionError when the CLI
    would refuse them, or when a flag is not spelled exactly as defined (argparse accepts
    unambiguous abbreviations, which would hide a renamed flag)."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:
        raise AssertionError(f"ddiloco refuses `ddiloco {shlex.join(argv)}` (exit code {stop.code})") from None
    sub = _subcommands(parser)[argv[0]]
    defined = {flag for action in sub._actions for flag in action.option_strings}  # noqa: SLF001
    own = argv[1:argv.index("--")] if "--" in argv else argv[1:]  # after "--": the command `ddiloco launch` runs
    for token in own:
        if token.startswith("--") and token.split("=", 1)[0] not in defined:
            raise AssertionError(f"`ddiloco {argv[0]}` has no flag {token.split('=', 1)[0]} (abbreviated?)")
    return args


def doc_commands(page: Path) -> list[list[str]]:
    """``ddiloco`` arguments of each command in a page's ```bash blocks (continuations joined;
    other blocks hold output, which may start with "ddiloco" too): ``ddiloco ...``,
    ``... && ddiloco ...`` and ``kubectl exec POD -- ddiloco ...``."""
    lines: list[str] = []
    in_block = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            in_block = not in_block and line.strip() == "```bash"
        elif in_block:
            if lines and lines[-1].endswith("\\"):
                lines[-1] = lines[-1][:-1] + " " + line.strip()
            else:
                lines.append(line.strip())
    commands = []
    for line in lines:
        tokens = shlex.split(line, comments=True)
        starts = [i for i, t in enumerate(tokens) if t == "ddiloco" and (i == 0 or tokens[i - 1] in ("&&", "--"))]
        if starts:
            commands.append(tokens[starts[0] + 1:])
    return commands
