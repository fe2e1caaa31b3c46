"""``ddiloco run``'s live view: each learner's state and the global model while the run goes.

On a terminal, a rich ``Live`` panel redrawn a few times a second from the latest
read-only snapshot of the virtual cluster (:mod:`ddiloco.sim.snapshot`) and the latest
metrics row; elsewhere (a pipe, a log file, CI), one plain line per evaluation. The view
only keeps references to values the run hands it: it never reaches into the cluster, so a
watched run and an unwatched one train the same weights.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from ddiloco.outputs.reporting import ProgressFn
from ddiloco.sim.snapshot import ClusterSnapshot, LearnerState, LearnerView, SnapshotFn

STATE_STYLE = {
    LearnerState.TRAINING: "green", LearnerState.WAITING: "yellow", LearnerState.JOINING: "cyan",
    LearnerState.REJOINING: "cyan", LearnerState.DOWN: "bold red", LearnerState.FROZEN: "magenta",
    LearnerState.STOPPED: "dim", LearnerState.FAILED: "bold red", LearnerState.LATE: "dim",
}
RECENT_REJOIN_S = 10.0
"""For this many virtual seconds after a rejoin the view says so (a rejoin itself lasts milliseconds)."""


@dataclass(slots=True)
class _Watch:
    """What the run has handed the view so far: the latest metrics row and snapshot."""

    label: str
    started: float = field(default_factory=time.perf_counter)
    fraction: float = 0.0
    row: dict[str, Any] | None = None
    snapshot: ClusterSnapshot | None = None

    def on_row(self, fraction: float, row: dict[str, Any]) -> None:
        self.fraction, self.row = fraction, row

    def on_snapshot(self, snapshot: ClusterSnapshot) -> None:
        self.fraction, self.snapshot = snapshot.fraction_done, snapshot

    def render(self) -> RenderableType:
        s = self.snapshot
        head = Table.grid(padding=(0, 1))
        head.add_row(Text(self.label, style="bold"), ProgressBar(total=1.0, completed=self.fraction, width=30),
                     f"{self.fraction:>4.0%}", f"{time.perf_counter() - self.started:.0f} s elapsed")
        if s is None:
            return Group(head, self._row_line())
        learners = Table(box=None, padding=(0, 2), show_edge=False)
        for column in ("learner", "state", "steps", "failures", ""):
            learners.add_column(column, justify="right" if column in ("steps", "failures") else "left")
        for learner in s.learners:
            learners.add_row(learner.name, Text(learner.state.value, style=STATE_STYLE[learner.state]),
                             str(learner.steps), str(learner.failures), self._note(learner, s.time_s))
        model = Text.assemble(("global model ", "bold"), f"fragment versions {' '.join(map(str, s.versions))} · "
                              f"eval loss {s.eval_loss:.3f} (t={s.eval_at_s:.0f} s)")
        run = Text(f"virtual t={s.time_s:.0f} s · tokens {s.tokens:,} · goodput so far {s.goodput:.0%}\n"
                   f"merges {s.merges} · failures {s.failures} · rejoins {s.rejoins}", style="dim")
        return Group(head, learners, model, run)

    def _note(self, learner: LearnerView, now_s: float) -> str:
        notes = ["slow"] if learner.slow else []
        rejoined = learner.rejoined_at_s
        if rejoined is not None and now_s - rejoined < RECENT_REJOIN_S and learner.state is LearnerState.TRAINING:
            notes.append(f"rejoined at t={rejoined:.0f} s")
        return ", ".join(notes)

    def _row_line(self) -> str:
        r = self.row
        if r is None:
            return "starting: building the workload and evaluating the initial model"
        counts = "".join(f" · {key} {r[key]}" for key in ("failures", "rejoins", "merges") if key in r)
        return (f"virtual t={r['virtual_time_s']:.0f} s · eval loss {r['eval_loss']:.3f} · "
                f"goodput so far {r['goodput']:.0%}{counts}")

    def plain_line(self) -> str:
        """One line per evaluation where nothing can be redrawn: the row's own figures."""
        return f"{self.label}  {self.fraction:>4.0%}  {self._row_line()}"


@contextlib.contextmanager
def live_view(label: str, console: Console) -> Iterator[tuple[ProgressFn, SnapshotFn]]:
    """Yield (progress, observer) callbacks for :func:`ddiloco.sim.experiment.run_virtual`."""
    watch = _Watch(label)
    if not console.is_terminal:
        def on_row(fraction: float, row: dict[str, Any]) -> None:
            watch.on_row(fraction, row)
            console.print(watch.plain_line(), highlight=False, soft_wrap=True)

        yield on_row, watch.on_snapshot
        return
    with Live(console=console, get_renderable=watch.render, refresh_per_second=4):
        yield watch.on_row, watch.on_snapshot
