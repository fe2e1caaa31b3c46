"""Progress bars, result tables and "what happened" panels on the terminal (rich).

Every figure shown here is read from a summary or a metrics row, the same values the files
hold. Tables and panels are laid out for the terminal's width: side by side where they fit,
stacked where they do not, and a table too wide for the terminal is turned on its side (one
column per run) rather than cut: no value is ever truncated.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from rich.columns import Columns
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

if TYPE_CHECKING:
    from ddiloco.outputs.reporting import ProgressFn

console = Console(stderr=True)
PIPED_WIDTH = 180
"""Width of the report when stdout is not a terminal (a log file need not squeeze it to 80)."""
PANEL_WIDTH = 56
"""A "what happened" panel beside a table; stacked below it, it takes up to the terminal's width."""
PANEL_MAX_WIDTH = 100


@contextlib.contextmanager
def progress_bar(label: str) -> Iterator[ProgressFn]:
    """Yield a callback that moves a bar and shows the latest eval loss, goodput and versions."""
    progress = Progress(
        TextColumn("[bold]{task.fields[label]}"),
        BarColumn(),
        TextColumn("{task.percentage:>5.1f}%"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[summary]}"),
        console=console,
        disable=not sys.stderr.isatty() and not console.is_terminal,
    )
    with progress:
        task = progress.add_task("run", total=1.0, label=label, summary="")

        def update(fraction: float, row: dict[str, Any]) -> None:
            summary = (
                f"loss {row['eval_loss']:.3f}  goodput so far {row['goodput']:.0%}  "
                f"t={row['virtual_time_s']:.0f}s  versions {sum(row['fragment_versions'])}"
            )
            progress.update(task, completed=fraction, summary=summary)

        yield update


def _number(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


COLUMNS: tuple[tuple[str, Callable[[dict[str, Any]], str]], ...] = (
    ("mode", lambda s: s["mode"] + (" (interrupted)" if s.get("interrupted") else "")),
    ("learners", lambda s: str(s["learners"])),
    ("tokens", lambda s: f"{s['tokens']:,}"),
    ("eval loss", lambda s: _number(s["eval_loss"], ".4f")),
    ("goodput", lambda s: f"{s['goodput']:.1%}"),
    ("uptime", lambda s: f"{s['uptime']:.1%}"),
    ("MB up", lambda s: f"{s['bytes_up'] / 1e6:.2f}"),
    ("MB down", lambda s: f"{s['bytes_down'] / 1e6:.2f}"),
    ("virtual s", lambda s: f"{s['virtual_time_s']:.0f}"),
    ("versions", lambda s: str(sum(s["fragment_versions"]))),
    ("wall s", lambda s: f"{s['wall_time_s']:.1f}"),
)
"""The result table's columns and how each is read from a summary."""


def summary_table(summaries: Sequence[dict[str, Any]], title: str, *, width: int | None = None) -> Table:
    """One row per run; where that is wider than ``width``, one column per run instead."""
    wide = Table(title=title)
    for name, _ in COLUMNS:
        wide.add_column(name, justify="left" if name == "mode" else "right")
    for s in summaries:
        wide.add_row(*(cell(s) for _, cell in COLUMNS))
    if width is None or _width(wide) <= width:
        return wide
    tall = Table(title=title, min_width=min(width, len(title) + 4))  # the title on one line where it fits
    tall.add_column("")
    for s in summaries:
        tall.add_column(COLUMNS[0][1](s), justify="right")
    for name, cell in COLUMNS[1:]:
        tall.add_row(name, *(cell(s) for s in summaries))
    return tall


def what_happened(summary: dict[str, Any], *, slow_factor: float) -> list[str] | None:
    """The run's story in plain words, from its ``events`` (None for a run that has none: an older summary)."""
    events = summary.get("events")
    if events is None:
        return None
    slow = _slow_line(events, slow_factor)
    return [*_story(summary, events), *([slow] if slow else []),
            f"Goodput {summary['goodput']:.0%} (chip-time whose work reached the global model), "
            f"uptime {summary['uptime']:.0%}, eval loss {_number(summary['eval_loss'], '.4f')} nats/byte."]


def compare_story(summaries: Sequence[dict[str, Any]], *, slow_factor: float, mtbf_s: float,
                  downtime_s: float) -> list[str]:
    """``ddiloco compare``'s "what happened": what the same failure trace did to each mode."""
    lines = [f"One failure trace for every mode (each learner: MTBF {mtbf_s:g} s, down {downtime_s:g} s on average); "
             "each mode meets its failures until its own end." if mtbf_s else "No failures in this comparison."]
    lines += [f"{s['mode']}: " + " ".join(_story(s, s["events"])) for s in summaries if s.get("events")]
    slow = _slow_line(summaries[0]["events"], slow_factor) if summaries and summaries[0].get("events") else None
    return lines + ([f"In every mode, {slow}"] if slow else [])


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' * (n != 1)}"


def _slow_line(events: dict[str, Any], slow_factor: float) -> str | None:
    if not events["slow_learners"]:
        return None
    names = ", ".join(f"learner-{m}" for m in events["slow_learners"])
    return f"{names} on {slow_factor - 1:.0%} slower hardware."


def _story(summary: dict[str, Any], events: dict[str, Any]) -> list[str]:
    lines = []
    if summary.get("interrupted"):
        lines.append(f"Interrupted at {summary['done']:.0%} of the budget (virtual t={summary['virtual_time_s']:.0f} s); "
                     "this is what it did until then.")
    from ddiloco.core.shared.protocol_config import (
        Mode,  # beside the codecs: torch (``ddiloco status`` prints tables too)
    )

    story = _diloco_story if Mode(summary["mode"]).uses_protocol else _dp_story
    return lines + story(summary, events)


def _diloco_story(summary: dict[str, Any], events: dict[str, Any]) -> list[str]:
    failures, rejoins = events["failures"], events["rejoins"]
    pause, start = events["longest_pause_s"], events["longest_pause_from_s"]
    return [
        f"{_plural(failures, 'learner failure')} and {_plural(rejoins, 'rejoin')}: "
        + ("a restarted learner fetches the global state and trains on." if failures else "no failures in this run."),
        f"{_plural(events['merges'], 'merge')}; the global model's longest pause without one was {pause:.1f} "
        f"{_seconds(summary)} (from t={start:.0f} s) of {summary['virtual_time_s']:.0f} s.",
    ]


def _seconds(summary: dict[str, Any]) -> str:
    """Real processes count wall seconds where the virtual cluster counts virtual ones."""
    return "s" if summary.get("runtime") == "processes" else "virtual s"


def _dp_story(summary: dict[str, Any], events: dict[str, Any]) -> list[str]:
    failures, rollbacks = events["failures"], events["rollbacks"]
    lines = [f"{_plural(failures, 'replica failure')}" + (": no failures in this run." if not failures else ".")]
    if rollbacks:
        lost = sum(r["lost_steps"] for r in rollbacks)
        stopped_s = sum(r["resumed_at_s"] - r["failed_at_s"] for r in rollbacks)
        worst = max(rollbacks, key=lambda r: (r["lost_steps"], r["resumed_at_s"] - r["failed_at_s"]))
        lines.append(f"Data parallel needs every replica: {_plural(len(rollbacks), 'time')} the whole job stopped until "
                     f"all were back, then restarted from its last checkpoint ({stopped_s:.0f} of "
                     f"{summary['virtual_time_s']:.0f} virtual s stopped, {_plural(lost, 'step')} discarded).")
        if worst["lost_steps"]:
            lines.append(f"The failure at t={worst['failed_at_s']:.0f} s cost {_plural(worst['lost_steps'], 'step')}: "
                         f"at t={worst['resumed_at_s']:.0f} s it went back to its checkpoint of "
                         f"t={worst['checkpoint_s']:.0f} s, so its loss went back up.")
    elif events["reconfigurations"]:
        lines.append(f"Elastic: the job went on with the replicas left, pausing to reconfigure "
                     f"{_plural(events['reconfigurations'], 'time')} (a failed replica's step in flight is lost).")
    lines.append(f"Longest stretch without a step: {events['longest_pause_s']:.1f} {_seconds(summary)} "
                 f"(from t={events['longest_pause_from_s']:.0f} s).")
    return lines


def _width(renderable: RenderableType) -> int:
    return Console(width=10_000).measure(renderable).maximum


def report_console() -> Console:
    """stdout: the terminal's width, else ``$COLUMNS`` where set (rich reads it), else :data:`PIPED_WIDTH`
    when piped or logged (issue 57: piped with ``COLUMNS=120``, the report was 171 columns wide)."""
    out = Console()
    return out if out.is_terminal or os.environ.get("COLUMNS", "").isdigit() else Console(width=PIPED_WIDTH)


@contextlib.contextmanager
def live_lines(renderable: RenderableType, out: Console) -> Iterator[Live]:
    """A live view of a few lines that stays on screen, its last line ended: rich ends it only on a
    terminal, so in a log the next line (``ddiloco chaos``'s baseline: ``sync: status page at ...``)
    ran on after it."""
    with Live(renderable, console=out, refresh_per_second=4, transient=False) as live:
        yield live
    if not out.is_terminal:
        out.line()


def print_table(table: Table) -> None:
    report_console().print(table)


def print_report(summaries: Sequence[dict[str, Any]], title: str, story: list[str] | None = None, *,
                 beside: bool = True, out: Console | None = None) -> None:
    """The result table and the "what happened" panel on stdout (or ``out``), laid out for its
    width: the panel beside the table where both fit (and ``beside``), else below it."""
    out = out or report_console()
    table = summary_table(summaries, title, width=out.width)
    if not story:
        out.print(table)
    elif beside and _width(table) + 1 + PANEL_WIDTH <= out.width:
        out.print(Columns([table, Panel("\n".join(story), title="what happened", expand=False, width=PANEL_WIDTH)]))
    else:
        out.print(Group(table, Panel("\n".join(story), title="what happened", expand=False,
                                     width=min(out.width, PANEL_MAX_WIDTH))))
