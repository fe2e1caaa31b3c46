"""What a run writes and shows, whichever driver ran it: summary, metrics rows, config, plot.

The virtual cluster (:mod:`ddiloco.experiment`) and the process launcher
(:mod:`ddiloco.runtime.launcher`) both end in :func:`summarize` and :func:`write_run`, so
a simulated run and a real one produce the same files with the same keys (and the same
TensorBoard event file, :mod:`ddiloco.tb_log`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Sequence

from ddiloco.config import Config
from ddiloco.errors import ConfigError
from ddiloco.tb_log import write_run_events

ProgressFn = Callable[[float, dict[str, Any]], None]
"""Called with the run's progress in [0, 1] and the latest metrics row."""

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


def write_run(out: Path, config: Config, summary: dict[str, Any], rows: Sequence[dict[str, Any]]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_config(out / "config.toml", config)
    with (out / "metrics.jsonl").open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    write_run_events(out, rows)
    plot_runs(out / "plot.png", {summary["mode"]: rows}, title=f"{summary['mode']}, M={summary['learners']}")


def prepare_out(path: str) -> Path:
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {path!r} exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"--out {path!r}: cannot create directory ({err.strerror})") from None
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


def plot_runs(path: Path, runs: dict[str, Sequence[dict[str, Any]]], *, title: str) -> None:
    """Eval loss and goodput against virtual time, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, good_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, rows in runs.items():
        t = [r["virtual_time_s"] for r in rows]
        loss_ax.plot(t, [r["eval_loss"] for r in rows], marker="o", markersize=3, label=label)
        good_ax.plot(t[1:], [r["goodput"] for r in rows][1:], marker="o", markersize=3, label=label)
    loss_ax.set(xlabel="virtual time (s)", ylabel="eval loss (nats/byte)", title="Held-out loss of the global model")
    good_ax.set(xlabel="virtual time (s)", ylabel="goodput", title="Goodput up to t (work that reached the model)", ylim=(0, 1.05))
    for ax in (loss_ax, good_ax):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
