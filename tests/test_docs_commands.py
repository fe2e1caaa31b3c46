"""Every `ddiloco` command line in the user docs' code blocks is one the CLI accepts."""

from __future__ import annotations

from pathlib import Path

import pytest

from cli_lines import check_command, doc_commands

DOCS = Path(__file__).resolve().parents[1] / "docs"
PAGES = ("quickstart.md", "concepts.md", "operations.md", "config.md", "deploy.md")


@pytest.mark.parametrize("page", PAGES)
def test_command_lines_are_accepted(page):
    commands = doc_commands(DOCS / page)
    if page in ("quickstart.md", "operations.md"):
        assert len(commands) >= 5
    if page == "deploy.md":
        assert len(commands) >= 4
    for argv in commands:
        check_command(argv)


def test_a_wrong_flag_is_caught():
    with pytest.raises(AssertionError, match="refuses"):
        check_command(["sync", "--http-prot", "8080"])
    with pytest.raises(AssertionError, match="no flag"):
        check_command(["status", "127.0.0.1:7000", "--js"])
