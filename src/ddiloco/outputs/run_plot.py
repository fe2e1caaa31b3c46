"""``plot.png`` and ``compare.png``: eval loss and goodput over virtual time, and what happened.

Curves alone do not say what the system is for. Below them, one lane per learner shows
when the failure trace took it down, when it rejoined, and which learner runs on the slower
hardware; the loss and goodput panels carry the same failures as thin lines. A non-elastic
data-parallel run also marks each stretch where the whole job stood still and then went
back to its last checkpoint: the straight line and the jump in its loss curve.

Everything drawn here comes from the metrics rows and ``summary.json``'s ``events``
(:class:`ddiloco.sim.timeline.RunEvents`), so a plot can be redrawn from a run's files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

FAILURE_COLOR = "#d62728"
REJOIN_COLOR = "#0b7285"
STOPPED_COLOR = "0.55"
UP_COLOR = "#2ca02c"
SLOW_COLOR = "#bcbd22"
MAX_LINES = 16
"""More failures than this are shown only in the lanes: a line each would hide the curves."""


def plot_runs(path: Path, runs: Mapping[str, Sequence[dict[str, Any]]], *, title: str,
              events: Mapping[str, Mapping[str, Any] | None] | None = None, slow_factor: float = 1.18) -> None:
    """Eval loss and goodput against virtual time, one line per run; with ``events`` (a run's
    ``summary.json`` ``events`` by label), the learners' lanes and the failures, rejoins and
    rollbacks marked. Runs of one comparison share their failure trace, so one set of lanes serves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    known = {label: e for label, e in (events or {}).items() if e}
    end_s = max((r["virtual_time_s"] for rows in runs.values() for r in rows), default=0.0)
    lanes = max((len(_learners(e)) for e in known.values()), default=0)
    stopped = {label: e["rollbacks"] for label, e in known.items() if e.get("rollbacks")}
    if known:
        fig, (loss_ax, good_ax, lane_ax) = plt.subplots(
            3, 1, figsize=(11, 7.5 + 0.25 * lanes), sharex=True,
            gridspec_kw={"height_ratios": [2.4, 1.4, 0.6 + 0.32 * (lanes + len(stopped))]})
    else:
        fig, (loss_ax, good_ax) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True, gridspec_kw={"height_ratios": [2.4, 1.4]})
    for label, rows in runs.items():
        t = [r["virtual_time_s"] for r in rows]
        loss_ax.plot(t, [r["eval_loss"] for r in rows], marker="o", markersize=3, label=label)
        good_ax.plot(t[1:], [r["goodput"] for r in rows][1:], marker="o", markersize=3, label=label)
    loss_ax.set(ylabel="eval loss (nats/byte)", title="Held-out loss of the global model")
    good_ax.set(ylabel="goodput", title="Goodput so far (work that had reached the global model by t)", ylim=(0, 1.05))
    if known:
        story = max(known.values(), key=lambda e: len(e["outages"]))  # the longest run saw the most of the trace
        _mark_failures(story, (loss_ax, good_ax))
        for label, rollbacks in stopped.items():
            _mark_rollbacks(label, rollbacks, loss_ax)
        _draw_lanes(lane_ax, story, known, stopped, end_s, slow_factor)
        lane_ax.set_xlabel("virtual time (s)")
    else:
        good_ax.set_xlabel("virtual time (s)")
    for ax in (loss_ax, good_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.005, 1.0))  # outside: never over a curve
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _learners(events: Mapping[str, Any]) -> list[int]:
    seen = {o[0] for o in events["outages"]} | {r[0] for r in events["rejoined_at"]} | set(events["slow_learners"])
    return list(range(max(seen) + 1)) if seen else []


def _mark_failures(events: Mapping[str, Any], axes: Sequence[Any]) -> None:
    outages, rejoins = events["outages"], events["rejoined_at"]
    if len(outages) + len(rejoins) > MAX_LINES:
        return
    for ax in axes:
        for i, (_, down_s, _) in enumerate(outages):
            ax.axvline(down_s, color=FAILURE_COLOR, lw=0.8, ls="--", alpha=0.7, label="learner failure" if i == 0 else None)
        for i, (_, at_s) in enumerate(rejoins):
            ax.axvline(at_s, color=REJOIN_COLOR, lw=0.8, ls=":", alpha=0.9, label="rejoin" if i == 0 else None)


def _mark_rollbacks(label: str, rollbacks: Sequence[Mapping[str, Any]], ax: Any) -> None:
    """Where the job stood still, and the checkpoint it went back to."""
    for i, r in enumerate(rollbacks):
        ax.axvspan(r["failed_at_s"], r["resumed_at_s"], color=STOPPED_COLOR, alpha=0.15, lw=0,
                   label=f"{label} stopped, then back to its checkpoint" if i == 0 else None)
    worst = max(rollbacks, key=lambda r: (r["lost_steps"], r["resumed_at_s"] - r["failed_at_s"]))
    ax.annotate(f"{label}: failure at t={worst['failed_at_s']:.0f} s; at t={worst['resumed_at_s']:.0f} s back to\n"
                f"its checkpoint of t={worst['checkpoint_s']:.0f} s, {worst['lost_steps']} steps discarded",
                xy=(worst["resumed_at_s"], 0.97), xycoords=("data", "axes fraction"), fontsize=7,
                ha="left", va="top", color="0.25")


def _draw_lanes(ax: Any, story: Mapping[str, Any], known: Mapping[str, Mapping[str, Any]],
                stopped: Mapping[str, Sequence[Mapping[str, Any]]], end_s: float, slow_factor: float) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    learners = _learners(story)
    slow = set(story["slow_learners"])
    names = [f"learner-{m}" + (f" (slow, +{slow_factor - 1:.0%})" if m in slow else "") for m in learners]
    for m in learners:
        ax.broken_barh([(0, end_s)], (m - 0.3, 0.6), color=SLOW_COLOR if m in slow else UP_COLOR, alpha=0.55)
        spans = [(down, (up if up is not None else end_s) - down) for who, down, up in story["outages"] if who == m]
        ax.broken_barh(spans, (m - 0.3, 0.6), color=FAILURE_COLOR)
    rejoiner = next((label for label, e in known.items() if e["rejoined_at"]), None)  # one run's: they differ by mode
    rejoins = [(m, at) for m, at in known[rejoiner]["rejoined_at"]] if rejoiner else []
    if rejoins:
        ax.scatter([at for _, at in rejoins], [m for m, _ in rejoins], marker="|", s=320, linewidths=2.5, color=REJOIN_COLOR,
                   zorder=3)
    for row, (label, rollbacks) in enumerate(stopped.items(), start=len(learners)):
        ax.broken_barh([(r["failed_at_s"], r["resumed_at_s"] - r["failed_at_s"]) for r in rollbacks],
                       (row - 0.3, 0.6), color=STOPPED_COLOR)
        names.append(f"{label} job")
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.set_ylim(-0.6, len(names) - 0.4)
    ax.invert_yaxis()
    handles = [Patch(color=UP_COLOR, alpha=0.55, label="up"), Patch(color=FAILURE_COLOR, label="down (failure)")]
    if slow:
        handles.append(Patch(color=SLOW_COLOR, alpha=0.55, label=f"up, {slow_factor - 1:.0%} slower hardware"))
    if rejoins:
        handles.append(Line2D([], [], marker="|", ls="", markersize=12, color=REJOIN_COLOR,
                              label="rejoined" + (f" ({rejoiner})" if len(known) > 1 else "")))
    if stopped:
        handles.append(Patch(color=STOPPED_COLOR, label="job stopped, then rolled back"))
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.005, 1.0))
    ax.set_title("Learners: failures, rejoins, slow hardware", fontsize=9)
