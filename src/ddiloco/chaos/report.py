"""What a chaos run showed: chaos.json, the properties it must hold, a table and a timeline plot."""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any, Callable, TypeVar

from rich.table import Table

from ddiloco.chaos.batch_counts import count_batches
from ddiloco.chaos.outcome import ChaosOutcome, Sample, ShardCounts
from ddiloco.chaos.schedule import is_sync_target, learner_name
from ddiloco.core.shared.liveness import pause_bound_s
from ddiloco.core.sync_side.refusals import honest_total
from ddiloco.core.sync_side.run_state import RunPhase
from ddiloco.outputs.tb_log import STEP_KEY, TIME_KEY, write_run_events
from ddiloco.settings.config import Config
from ddiloco.settings.fault_kinds import REAL, FaultKind

LOOP_SLACK = 1
"""Rejoins of one learner beyond those its faults explain that are not yet a loop (one update
lost under load, a lease that ran out on a busy machine)."""

MAX_LABELS = 20
"""Faults named above the plot; beyond this many only their colours mark them."""
KIND_COLORS = {kind: f"C{i % 10}" for i, kind in enumerate(FaultKind)}
"""A colour per fault kind, fixed by its place among all kinds (matplotlib's default cycle)."""
Polled = TypeVar("Polled", Sample, ShardCounts)


def by_incarnation(polls: list[Polled]) -> list[list[Polled]]:
    """Consecutive polls of one synchronizer process each (of one set of shard processes, for a
    :class:`Sample` of them all)."""
    groups: list[list[Polled]] = []
    for p in polls:
        if not groups or groups[-1][-1].instance_id != p.instance_id:
            groups.append([])
        groups[-1].append(p)
    return groups


def across_incarnations(samples: list[Sample], counts: Callable[[ShardCounts], dict[str, int]]) -> list[dict[str, int]]:
    """A counter each synchronizer process keeps per key (and checkpoints), totalled over its
    incarnations: one total per shard. Each shard restarts on its own, so each is followed on its own.

    Within an incarnation a count only grows, so its peak is what it reached (a learner the
    registry forgot keeps its peak here). A resumed incarnation starts from its checkpoint's
    counts: what an earlier one counted after its last checkpoint is its peak above the next
    one's first sample (what happened between the last poll and a kill, or before the resumed
    one's first poll, is missed).
    """
    shards = len(samples[0].shards) if samples else 0
    return [_one_process([s.shards[i] for s in samples], counts) for i in range(shards)]


def _one_process(polls: list[ShardCounts], counts: Callable[[ShardCounts], dict[str, int]]) -> dict[str, int]:
    groups = by_incarnation(polls)
    peaks = [_peak(group, counts) for group in groups]
    total = collections.Counter(peaks[-1] if peaks else {})
    for killed, resumed in zip(peaks, groups[1:]):
        first = counts(resumed[0])
        for key, count in killed.items():
            total[key] += max(0, count - first.get(key, 0))
    return dict(sorted(total.items()))


def _peak(group: list[ShardCounts], counts: Callable[[ShardCounts], dict[str, int]]) -> dict[str, int]:
    peak: dict[str, int] = {}
    for c in group:
        for key, count in counts(c).items():
            peak[key] = max(peak.get(key, 0), count)
    return peak


def by_reason(samples: list[Sample], counts: Callable[[ShardCounts], dict[str, int]]) -> dict[str, int]:
    """A count per reason over the run (``counts`` of each poll), summed over the shards."""
    total: collections.Counter[str] = collections.Counter()
    for shard in across_incarnations(samples, counts):
        total.update(shard)
    return {reason: n for reason, n in sorted(total.items()) if n}


def rejections(samples: list[Sample]) -> dict[str, int]:
    """Rejections per reason over the run, summed over the shards."""
    return by_reason(samples, lambda c: c.rejections)


def rejoins_by_learner(samples: list[Sample]) -> dict[str, int]:
    """Registrations beyond each learner's first, at every synchronizer shard, summed: after a kill,
    a freeze, a partition (one at each shard) or a new incarnation of a shard (one at that shard).
    Read from the status's per-learner count, not from a log line, so rewording the synchronizer's
    log cannot change it."""
    total: collections.Counter[str] = collections.Counter()
    for registered in across_incarnations(samples, lambda c: c.registrations):
        total.update({name: max(0, n - 1) for name, n in registered.items()})
    return dict(sorted(total.items()))


def explained_rejoins(outcome: ChaosOutcome, learners: int) -> dict[str, int]:
    """Per learner, the rejoins its faults may cause: one at each shard per fault on the learner,
    one per restart of any synchronizer process (at that shard)."""
    shards = len(outcome.sync_names)
    explained = {learner_name(i): len(outcome.sync_restarts) for i in range(learners)}
    for r in outcome.records:
        if r.started_s is not None and not r.skipped and r.fault.target in explained:
            explained[r.fault.target] += shards
    return explained


def rejoin_loops(rejoins: dict[str, int], explained: dict[str, int]) -> list[str]:
    """Learners that registered again more often than their faults explain: a rejoin loop."""
    return [f"{name} rejoined {n} times, {explained.get(name, 0)} explained by faults (a rejoin loop)"
            for name, n in rejoins.items() if n > explained.get(name, 0) + LOOP_SLACK]


def batch_figures(outcome: ChaosOutcome, period: int) -> dict[str, Any]:
    """Each learner's batches trained again and skipped across its restarts (``chaos/batch_counts.py``),
    and their totals; the allowance is one period H per restart."""
    positions = {lr["id"]: lr["data_position"] for lr in outcome.final_status.get("learners", [])}
    counts = {name: count_batches(processes, period, positions.get(name, 0))
              for name, processes in sorted(outcome.batches.items())}
    return {"batch_period": period,
            "batches_trained": sum(c.trained for c in counts.values()),
            "batches_retrained": sum(c.retrained for c in counts.values()),
            "batches_retrained_beyond_period": sum(c.retrained_beyond_period for c in counts.values()),
            "batches_skipped": sum(c.skipped for c in counts.values()),
            "batches_by_learner": {name: c.to_dict() for name, c in counts.items()}}


def build_report(outcome: ChaosOutcome, config: Config, *, window_s: float, seed: int,
                 baseline: dict[str, Any] | None, min_step_s: float = 0.0) -> dict[str, Any]:
    """chaos.json: the counts, the pause against its bound, the model against the undisturbed run."""
    injected = collections.Counter(str(r.fault.kind) for r in outcome.records
                                   if r.started_s is not None and not r.skipped)
    running = [s for s in outcome.samples if s.phase == RunPhase.RUNNING]
    left_down = {r.fault.target for r in outcome.records
                 if r.fault.kind is FaultKind.LEARNER_CRASH and not r.fault.restart and r.started_s is not None}
    alive_at_end = sum(1 for i in range(config.run.learners)
                       if running and running[-1].alive.get(learner_name(i), False))
    longest = max([max(s.longest_pause_s for s in g) for g in by_incarnation(outcome.samples)]
                  + outcome.restart_pauses_s, default=0.0)
    grace_s = max((s.grace_window_s for s in running), default=0.0)
    status = outcome.final_status
    rejoined = rejoins_by_learner(outcome.samples)
    explained = explained_rejoins(outcome, config.run.learners)
    report: dict[str, Any] = {
        "faults": {str(k): injected.get(str(k), 0) for k in REAL},
        "longest_pause_s": round(longest, 3),
        "pause_bound_s": round(pause_bound_s(config.protocol, grace_s), 3),
        "grace_window_s": round(grace_s, 3),
        "lease_s": config.protocol.lease_s,
        "sync_downtime_s": round(sum(up - down for down, up in outcome.sync_down), 3),
        "sync_restarts": [r.to_dict() for r in outcome.sync_restarts],
        "rejoins": sum(rejoined.values()),
        "rejoins_by_learner": rejoined,
        "rejoins_explained": explained,
        "learners_alive_at_end": alive_at_end,
        "learners_expected_at_end": config.run.learners - len(left_down),
        "learners": config.run.learners,
        "rejected": rejections(outcome.samples),
        "refused_steps": by_reason(outcome.samples, lambda c: c.refused_steps),
        "goodput": status.get("goodput"),
        "uptime": status.get("model_uptime"),
        "eval_loss": outcome.eval_loss,
        "baseline_eval_loss": baseline["eval_loss"] if baseline else None,
        "tokens": status.get("tokens"),
        "baseline_tokens": baseline["tokens"] if baseline else None,
        "fragment_versions": [f["version"] for f in status.get("fragments", [])],
        **batch_figures(outcome, config.protocol.period),
        "completed": outcome.completed,
        "seed": seed,
        "fault_window_s": window_s,
        "run_budget_s": config.run.time_s,
        "min_step_s": min_step_s,
        "wall_s": round(outcome.wall_s, 1),
        "connections_reset": outcome.connections_reset,
        "proxy_bytes": outcome.proxy_bytes,
        "link_bytes": outcome.link_bytes,
        "stopped": outcome.stopped,
        "schedule": [{**r.fault.to_dict(),
                      "started_s": None if r.started_s is None else round(r.started_s, 2),
                      "ended_s": None if r.ended_s is None else round(r.ended_s, 2),
                      **({"skipped": r.skipped} if r.skipped else {})} for r in outcome.records],
    }
    report["honest_refused_steps"] = honest_total(report["refused_steps"])  # every chaos learner is honest
    report["violations"] = violations(report, outcome.failure)
    # Faults of the schedule the run ended before (the schedule's clock stops while a synchronizer is
    # down, so a late fault can fall past the end): said, not judged; a run stopped by a signal says why.
    report["not_reached"] = [] if outcome.stopped else [
        f"{r.fault.describe()} at {r.fault.at_s:.1f}s" for r in outcome.records if r.started_s is None]
    return report


def violations(report: dict[str, Any], failure: str) -> list[str]:
    """The properties a chaos run must hold, each broken one named in one line."""
    found = []
    if not report["completed"]:
        found.append(f"the run did not complete: {failure.splitlines()[0] if failure else 'not finished'}")
    if report["learners_alive_at_end"] < report["learners_expected_at_end"]:
        found.append(f"learners alive at the end: {report['learners_alive_at_end']} of "
                     f"{report['learners_expected_at_end']} expected")
    if report["longest_pause_s"] > report["pause_bound_s"]:
        found.append(f"longest pause without a merge {report['longest_pause_s']:.2f}s exceeds the bound "
                     f"{report['pause_bound_s']:.2f}s (grace window + lease)")
    found += rejoin_loops(report.get("rejoins_by_learner", {}), report.get("rejoins_explained", {}))
    found += [f"{name} skipped {c['skipped']} batches of its data (never trained, although its stream moved past "
              "them)" for name, c in report.get("batches_by_learner", {}).items() if c["skipped"]]
    return found


def write_events(out: Path, samples: list[Sample]) -> None:
    """The polled status as a TensorBoard event file beside chaos.json, like a run's metrics rows:
    step = tokens merged, time = seconds after the first join (tokens go back after a
    synchronizer crash, as the global model does)."""
    write_run_events(out, [{STEP_KEY: s.tokens, TIME_KEY: s.t_s, "fragment_versions": list(s.versions),
                            "learners_alive": sum(s.alive.values()), "grace_window_s": s.grace_window_s,
                            "longest_pause_s": s.longest_pause_s} for s in samples if s.t_s >= 0])


def write_report(out: Path, report: dict[str, Any]) -> Path:
    path = out / "chaos.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path


def report_table(report: dict[str, Any], title: str) -> Table:
    table = Table(title=title)
    table.add_column("what")
    table.add_column("value", justify="right")
    faults = ", ".join(f"{k} {v}" for k, v in report["faults"].items())

    def num(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    rows = [
        ("faults injected", faults),
        ("longest pause without a merge", f"{report['longest_pause_s']:.2f} s"),
        ("pause bound (grace window + lease)", f"{report['pause_bound_s']:.2f} s"),
        ("synchronizer downtime", f"{report['sync_downtime_s']:.1f} s"),
        ("rejoins", str(report["rejoins"])),
        ("batches trained again (beyond one period)",
         f"{report['batches_retrained']:,} ({report['batches_retrained_beyond_period']:,} beyond "
         f"H={report['batch_period']} per restart) of {report['batches_trained']:,}"),
        ("batches skipped", f"{report['batches_skipped']:,}"),
        ("learners alive at the end", f"{report['learners_alive_at_end']} of {report['learners']}"),
        ("rejected", ", ".join(f"{k} {v}" for k, v in report["rejected"].items()) or "none"),
        ("goodput / model uptime", f"{num(report['goodput'], '.1%')} / {num(report['uptime'], '.1%')}"),
        ("honest steps refused (all refused, by reason)", f"{report.get('honest_refused_steps', 0):,} ("
         + (", ".join(f"{k} {v:,}" for k, v in report.get("refused_steps", {}).items()) or "none") + ")"),
        ("tokens (baseline)", f"{num(report['tokens'], ',')} ({num(report['baseline_tokens'], ',')})"),
        ("eval loss (baseline)", f"{num(report['eval_loss'], '.4f')} ({num(report['baseline_eval_loss'], '.4f')})"),
        ("verdict", "ok" if not report["violations"] else "; ".join(report["violations"])),
    ]
    for what, value in rows:
        table.add_row(what, value)
    return table


def plot_timeline(path: Path, outcome: ChaosOutcome, learners: int, *, title: str) -> None:
    """Fragment versions over time with every fault marked; below, each learner's state and the synchronizer's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    samples = [s for s in outcome.samples if s.t_s >= 0]
    end_s = max([s.t_s for s in samples] + [0.0])
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 6.5), sharex=True,
                                      gridspec_kw={"height_ratios": [2.2, 1.0 + 0.25 * learners]})
    fragments = len(samples[0].versions) if samples else 0
    for p in range(fragments):
        top.plot([s.t_s for s in samples], [s.versions[p] for s in samples], lw=1.2, label=f"fragment {p}")
    for down, up in outcome.sync_down:
        top.axvspan(down, up, color="0.85", zorder=0)
    used = set()
    shown = [r for r in outcome.records if r.started_s is not None and not r.skipped]
    last_label_s, lift = -1e9, 0
    for r in shown:
        color = KIND_COLORS[r.fault.kind]
        stop = r.ended_s if r.ended_s is not None else end_s
        top.axvline(r.started_s, color=color, lw=1.0 if len(shown) <= MAX_LABELS else 0.5, ls="--")
        top.axvspan(r.started_s, max(stop, r.started_s + 0.2), color=color, alpha=0.08, lw=0)
        used.add(r.fault.kind)
        if len(shown) > MAX_LABELS:
            continue  # a soak's hundred labels would be ink, not text: the colours and the legend say it
        lift = lift + 1 if r.started_s - last_label_s < 0.11 * max(end_s, 1.0) else 0  # stack labels that collide
        last_label_s = r.started_s
        top.text(r.started_s, 1.01 + 0.065 * (lift % 3), f"{r.fault.kind} {r.fault.target}",
                 transform=top.get_xaxis_transform(), fontsize=7, color=color, ha="left", va="bottom")
    top.set_ylabel("fragment version")
    handles, _ = top.get_legend_handles_labels()
    handles += [Patch(color=KIND_COLORS[k], label=str(k)) for k in REAL if k in used]
    handles.append(Patch(color="0.85", label="synchronizer down"))
    top.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    top.set_title(title, pad=40, fontsize=10)

    rows = [learner_name(i) for i in range(learners)] + list(outcome.sync_names)
    for y, name in enumerate(rows):
        if is_sync_target(name):
            spans = [(down, up - down) for down, up in outcome.sync_down_of(name)]
            bottom.broken_barh([(0, end_s)], (y - 0.3, 0.6), color="#2ca02c", alpha=0.6)
            bottom.broken_barh(spans, (y - 0.3, 0.6), color="0.3")
            continue
        alive_spans = _spans([(s.t_s, s.alive.get(name, False)) for s in samples])
        bottom.broken_barh(alive_spans, (y - 0.3, 0.6), color="#2ca02c", alpha=0.6)
        for r in outcome.records:
            if r.fault.target == name and r.started_s is not None and not r.skipped:
                stop = r.ended_s if r.ended_s is not None else end_s
                bottom.broken_barh([(r.started_s, max(0.3, stop - r.started_s))], (y - 0.14, 0.28),
                                   color=KIND_COLORS[r.fault.kind])
    for down, up in outcome.sync_down:  # nobody can say who is alive while the synchronizer is down
        bottom.axvspan(down, up, color="0.9", zorder=0)
    bottom.set_yticks(range(len(rows)), rows, fontsize=8)
    bottom.set_ylim(-0.6, len(rows) - 0.4)
    bottom.invert_yaxis()
    bottom.set_xlabel("seconds after the first join")
    bottom.legend(handles=[Patch(color="#2ca02c", alpha=0.6, label="alive (status)"),
                           Patch(color="0.3", label="synchronizer down"),
                           Patch(color="0.9", label="not observed")], fontsize=7, loc="upper left",
                  bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _spans(points: list[tuple[float, bool]], gap_s: float = 1.0) -> list[tuple[float, float]]:
    """(start, width) of the stretches where the flag held, from samples in time order.

    A stretch ends at its last sample when the next one is more than ``gap_s`` later (the
    synchronizer was down: nothing was observed in between).
    """
    spans: list[tuple[float, float]] = []
    since: float | None = None
    previous = None
    for t, flag in points:
        if since is not None and (not flag or t - previous > gap_s):
            spans.append((since, previous - since))
            since = None
        if flag and since is None:
            since = t
        previous = t
    if since is not None and previous is not None:
        spans.append((since, previous - since))
    return spans
