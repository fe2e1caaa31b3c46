"""What a run writes and shows, whichever driver ran it: summary, metrics rows, config, plot.

The virtual cluster (:mod:`ddiloco.sim.experiment`) and the process launcher
(:mod:`ddiloco.runtime.launch.launcher`) both end in :func:`summarize` and write through
:class:`RunWriter`, so a simulated run and a real one produce the same files with the same
keys (and the same TensorBoard event file, :mod:`ddiloco.outputs.tb_log`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from ddiloco.core.shared.errors import ConfigError
from ddiloco.outputs.run_plot import plot_runs
from ddiloco.outputs.tb_log import add_row, open_run_events
from ddiloco.settings.config import Config

if TYPE_CHECKING:
    import torch

ProgressFn = Callable[[float, dict[str, Any]], None]
"""Called with the run's progress in [0, 1] and the latest metrics row."""
RowFn = Callable[[dict[str, Any]], None]
"""Called with each metrics row as soon as it is recorded."""

MODEL_FILE = "model.safetensors"
"""The global model at the end of a run, as the model's ``state_dict``."""

SUMMARY_KEYS = (
    "mode", "learners", "tokens", "eval_loss", "goodput", "uptime", "bytes_up", "bytes_down",
    "virtual_time_s", "fragment_versions", "weights_sha256",
)


def summarize(config: Config, final: dict[str, Any], *, wall_s: float, **extra: Any) -> dict[str, Any]:
    """``summary.json``: the run's identity and its last metrics row, whichever runtime ran it."""
    return {
        "mode": config.run.mode,
        "learners": config.run.learners,
        "seed": config.run.seed,
        **{key: final[key] for key in ("tokens", "eval_loss", "goodput", "uptime", "bytes_up", "bytes_down",
                                       "virtual_time_s")},
        "wall_time_s": round(wall_s, 3),
        **extra,
    }


class RunWriter:
    """A run's files in ``out``, written as the run goes, so that an interrupted run keeps what it did.

    At the start: ``config.toml``, an empty ``metrics.jsonl`` and a fresh TensorBoard event
    file (a previous run's ``summary.json``, ``plot.png`` and ``model.safetensors`` are removed:
    they would pass for this run's). Every metrics row is appended to both as soon as it is recorded. At the end,
    :meth:`finish` writes ``summary.json`` and ``plot.png``; an interrupted run's
    :meth:`finish` writes the summary of what was done so far (``"interrupted": true``).
    """

    def __init__(self, out: Path, config: Config) -> None:
        self.out = out
        self.config = config
        out.mkdir(parents=True, exist_ok=True)
        write_config(out / "config.toml", config)
        for stale in ("summary.json", "plot.png", MODEL_FILE):
            (out / stale).unlink(missing_ok=True)
        self._metrics = (out / "metrics.jsonl").open("w")
        self._events = open_run_events(out)
        self.rows: list[dict[str, Any]] = []

    def add_row(self, row: dict[str, Any]) -> None:
        with _signals_held():  # an interrupt between the two files would leave them a row apart
            self.rows.append(row)
            self._metrics.write(json.dumps(row) + "\n")
            self._metrics.flush()
            add_row(self._events, row)
            self._events.flush()

    def finish(self, summary: dict[str, Any], model: torch.nn.Module | None = None) -> None:
        """Close the rows' files, then write ``model.safetensors`` (``model``'s ``state_dict``: load it
        with ``model.load_state_dict(safetensors.torch.load_file(...))``), ``summary.json`` (atomically)
        and ``plot.png``."""
        self._metrics.close()
        self._events.close()
        if model is not None:
            from ddiloco.workload.model_file import save_model

            save_model(self.out / MODEL_FILE, model)
        tmp = self.out / "summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        os.replace(tmp, self.out / "summary.json")
        if self.rows:
            mode = summary["mode"]
            plot_runs(self.out / "plot.png", {mode: self.rows}, events={mode: summary.get("events")},
                      slow_factor=self.config.cluster.slow_factor,
                      title=f"{mode}, M={summary['learners']}, seed {summary['seed']}"
                      + (" (interrupted)" if summary.get("interrupted") else ""))


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM wait until the block is left: a run stopped by either unwinds by
    KeyboardInterrupt, which must not land between two writes that belong together. The handlers are
    swapped, not the signal mask: a process-directed signal reaches Python through whichever thread
    the kernel picks (TensorBoard's writer thread among them), and Python runs handlers in the main
    thread only, so only the main thread can hold them."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {signum: signal.signal(signum, lambda signum, frame: caught.append(signum))
                for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in caught:  # delivered now, to whatever would have received them
            handler = previous[signum]
            if callable(handler):
                handler(signum, None)
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), signum)


def write_run(out: Path, config: Config, summary: dict[str, Any], rows: Sequence[dict[str, Any]]) -> None:
    """All of a run's files at once, for a driver that hands its rows over at the end (real processes)."""
    writer = RunWriter(out, config)
    for row in rows:
        writer.add_row(row)
    writer.finish(summary)


def prepare_out(path: str) -> Path:
    """The output directory, checked but not created: it is made when the run writes its
    first file, so a run refused before it starts (a bad seed, corpus or device) leaves nothing behind."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {path!r} exists and is not a directory")
    existing = next(p for p in (out.absolute(), *out.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"--out {path!r}: cannot create directory ({existing} is not a directory)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {path!r}: cannot create directory ({existing} is not writable)")
    return out


def write_config(path: Path, config: Config) -> None:
    """The resolved configuration as TOML (loadable again with ``--config``)."""
    lines = []
    for section, values in config.to_dict().items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            lines.append(f"{key} = {json.dumps(value)}")
        lines.append("")
    path.write_text("\n".join(lines))
