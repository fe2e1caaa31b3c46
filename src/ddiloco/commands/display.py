"""Progress bars, live summaries and result tables on the terminal (rich)."""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator, Sequence

from rich.columns import Columns
from rich.console import Console, RenderableType
from rich.panel import Panel
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from ddiloco.reporting import ProgressFn

console = Console(stderr=True)


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
                f"loss {row['eval_loss']:.3f}  goodput {row['goodput']:.0%}  "
                f"t={row['virtual_time_s']:.0f}s  versions {sum(row['fragment_versions'])}"
            )
            progress.update(task, completed=fraction, summary=summary)

        yield update


def summary_table(summaries: Sequence[dict[str, Any]], title: str) -> Table:
    table = Table(title=title)
    for column in ("mode", "learners", "tokens", "eval loss", "goodput", "uptime", "MB up", "MB down",
                   "virtual s", "versions", "wall s"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    for s in summaries:
        table.add_row(
            s["mode"], str(s["learners"]), f"{s['tokens']:,}", f"{s['eval_loss']:.4f}", f"{s['goodput']:.1%}",
            f"{s['uptime']:.1%}", f"{s['bytes_up'] / 1e6:.2f}", f"{s['bytes_down'] / 1e6:.2f}",
            f"{s['virtual_time_s']:.0f}", str(sum(s["fragment_versions"])), f"{s['wall_time_s']:.1f}",
        )
    return table


def what_happened(summary: dict[str, Any], *, slow_factor: float) -> Panel | None:
    """The run's story in plain words, from its ``events`` (None for a run that has none:
    the data-parallel baselines, real processes)."""
    events = summary.get("events")
    if events is None:
        return None
    failures, rejoins = events["failures"], events["rejoins"]
    lines = [
        f"{failures} learner failure{'s' * (failures != 1)} and {rejoins} rejoin{'s' * (rejoins != 1)}: "
        + ("a restarted learner fetches the global state and trains on." if failures else "no failures in this run."),
    ]
    if events["slow_learners"]:
        names = ", ".join(f"learner-{m}" for m in events["slow_learners"])
        lines.append(f"{names} on {slow_factor - 1:.0%} slower hardware.")
    pause, start = events["longest_pause_s"], events["longest_pause_from_s"]
    lines.append(f"{events['merges']} merges; the global model's longest pause without one was {pause:.1f} "
                 f"virtual s (from t={start:.0f} s) of {summary['virtual_time_s']:.0f} s.")
    lines.append(f"Goodput {summary['goodput']:.0%} (chip-time whose work reached the global model), "
                 f"uptime {summary['uptime']:.0%}, eval loss {summary['eval_loss']:.4f} nats/byte.")
    return Panel("\n".join(lines), title="what happened", expand=False, width=52)


def print_table(table: Table, beside: RenderableType | None = None) -> None:
    out = Console()
    if not out.is_terminal:
        out = Console(width=180)  # piped or logged: don't squeeze the columns to 80
    out.print(table if beside is None else Columns([table, beside]))
