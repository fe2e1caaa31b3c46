"""Issue 57, item 9: piped with ``COLUMNS=120``, ``ddiloco run``'s report was 171 columns wide (a
piped report took a fixed 180 columns, whatever the user asked for)."""

from __future__ import annotations

import pytest

from ddiloco.commands.display import PIPED_WIDTH, report_console


def test_a_piped_report_takes_the_width_columns_asks_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "120")
    out = report_console()
    assert not out.is_terminal and out.width == 120


def test_a_piped_report_without_columns_takes_a_logs_width(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    out = report_console()
    assert not out.is_terminal and out.width == PIPED_WIDTH
