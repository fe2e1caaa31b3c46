"""Every `ddiloco` command line in the user docs' code blocks is one the CLI accepts."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

import pytest

from ddiloco.cli import build_parser

DOCS = Path(__file__).resolve().parents[1] / "docs"
PAGES = ("quickstart.md", "concepts.md", "operations.md", "config.md")


def command_lines(page: Path) -> list[list[str]]:
    """``ddiloco`` arguments of each command in the page's ```bash blocks (continuations joined;
    other blocks hold output, which may start with "ddiloco" too)."""
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
        if line.startswith("ddiloco "):
            commands.append(shlex.split(line, comments=True)[1:])
        elif " && ddiloco " in line:
            commands.append(shlex.split(line.split(" && ddiloco ", 1)[1], comments=True))
    return commands


def check(argv: list[str]) -> None:
    parser = build_parser()
    try:
        parser.parse_args(argv)
    except SystemExit as stop:
        raise AssertionError(f"ddiloco refuses `ddiloco {shlex.join(argv)}` (exit code {stop.code})") from None
    (subparsers,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    defined = {flag for action in subparsers.choices[argv[0]]._actions for flag in action.option_strings}  # noqa: SLF001
    for token in argv[1:]:  # argparse accepts abbreviations, which would hide a renamed flag
        if token.startswith("--"):
            assert token.split("=", 1)[0] in defined, f"`ddiloco {argv[0]}` has no flag {token}"


@pytest.mark.parametrize("page", PAGES)
def test_command_lines_are_accepted(page):
    commands = command_lines(DOCS / page)
    if page in ("quickstart.md", "operations.md"):
        assert len(commands) >= 5
    for argv in commands:
        check(argv)


def test_a_wrong_flag_is_caught():
    with pytest.raises(AssertionError, match="refuses"):
        check(["sync", "--http-prot", "8080"])
    with pytest.raises(AssertionError, match="no flag"):
        check(["status", "127.0.0.1:7000", "--js"])
