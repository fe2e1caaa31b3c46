"""TensorBoard event files: a run's metrics rows and a learner process's progress.

Why: ``metrics.jsonl`` is for scripts and ``plot.png`` for a quick look at one run;
``tensorboard --logdir runs/`` overlays any number of runs (every mode of a ``compare``,
reruns with other settings) and zooms in, with no plotting code of ours.

A run's events are written as the run goes by :class:`ddiloco.outputs.reporting.RunWriter`, row by
row, from the very rows it appends to ``metrics.jsonl``, so both say the same thing (and an
interrupted run keeps both). The event file goes beside ``metrics.jsonl`` (TensorBoard then names the run after its directory:
``decoupled``, ``compare/dp``); an earlier run's event files there are removed first, as
``metrics.jsonl`` is overwritten. Every numeric key of a row is a scalar of the same name,
a list of numbers (``fragment_versions``) is one scalar per element (``fragment_versions/0``,
...); the step is ``tokens`` and the wall time is ``virtual_time_s``, so TensorBoard's
"Relative" horizontal axis reads virtual seconds (wall seconds since the start for
``--runtime processes``). Values are stored as float32, as TensorBoard stores scalars. Two
rows at the same tokens (a time budget while no learner trains) are both in the file, but
TensorBoard's server shows only the later one.

``ddiloco learner --tensorboard-dir DIR`` writes its progress lines (:class:`EventLog`)
with the inner step as the step and real wall time; a restarted learner adds a file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping

STEP_KEY = "tokens"
TIME_KEY = "virtual_time_s"


class EventLog:
    """One TensorBoard event file in ``logdir``, written by a background thread; close it to flush."""

    def __init__(self, logdir: str | Path, *, flush_secs: int = 10) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when asked for

        self.logdir = Path(logdir)
        self._writer = SummaryWriter(log_dir=str(self.logdir), flush_secs=flush_secs)

    def add(self, step: int, values: Mapping[str, Any], *, walltime: float | None = None) -> None:
        """Every number in ``values`` as a scalar at ``step``; lists of numbers as ``key/i``."""
        for tag, value in _scalars(values):
            self._writer.add_scalar(tag, value, global_step=step, walltime=walltime)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()

    def __enter__(self) -> "EventLog":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_run_events(out: Path) -> EventLog:
    """A fresh event file beside ``metrics.jsonl`` in ``out``; an earlier run's are removed first."""
    for stale in out.glob("events.out.tfevents.*"):
        stale.unlink()
    return EventLog(out)


def add_row(events: EventLog, row: Mapping[str, Any]) -> None:
    """One metrics row: its ``tokens`` as the step, its ``virtual_time_s`` as the wall time."""
    events.add(int(row[STEP_KEY]), {k: v for k, v in row.items() if k != STEP_KEY}, walltime=float(row[TIME_KEY]))


def write_run_events(out: Path, rows: Iterable[Mapping[str, Any]]) -> None:
    """Metrics rows as a complete event file in ``out`` (replacing an earlier one)."""
    with open_run_events(out) as events:
        for row in rows:
            add_row(events, row)


def _scalars(values: Mapping[str, Any]) -> Iterable[tuple[str, float]]:
    for key, value in values.items():
        if _is_number(value):
            yield key, float(value)
        elif isinstance(value, (list, tuple)) and all(_is_number(v) for v in value):
            for i, v in enumerate(value):
                yield f"{key}/{i}", float(v)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
