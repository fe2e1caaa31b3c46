"""The figures of ``bench_peers.py``: each run's metrics, the ratios ddiloco/torchft, the issue's targets, the
table and the plot (eval loss against wall time, both systems, kills marked).

Every figure is computed the same way for both systems from what :mod:`peers_systems` recorded:

- ``goodput``: batches whose work reached the global model on every fragment (ddiloco: the
  synchronizer's ``data_position`` of each learner; torchft: committed outer steps, as its replicas
  counted them) over the batches trained (every process's batch log, restarts and retraining included);
- ``tokens_per_s``: tokens trained from time 0 (every learner has trained a step) to the stop time, over
  those seconds (restarts included); ``others_tokens_per_s``: the learners that were not throttled, each
  over its own training seconds;
- ``eval_loss``: the global model's at the last evaluation at or before the stop time (equal wall time);
- ``longest_stall_s``: the longest time, from the first commit to the stop time, in which no fragment of
  anyone's work was committed;
- ``bytes_per_outer_step``: what a learner sends per H inner steps (ddiloco: gRPC bytes up, measured by
  the synchronizer; torchft: its all-reduce payloads × 2(n−1)/n, gloo's ring, counted by the replica);
- ``vmhwm_mib_max``: the largest peak resident memory of a learner (its process and its children).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from peers_supervisor import Scenario, System
from peers_systems import RunRecord


def tokens_at(record: RunRecord, t_s: float) -> float:
    """Tokens trained by ``t_s``, linearly between the harness's samples."""
    points = sorted(record.tokens_at)
    if not points:
        return 0.0
    if t_s <= points[0][0]:
        return points[0][1]
    for (t1, k1), (t2, k2) in zip(points, points[1:]):
        if t1 <= t_s <= t2:
            return k1 if t2 == t1 else k1 + (k2 - k1) * (t_s - t1) / (t2 - t1)
    return points[-1][1]


def metrics(record: RunRecord) -> dict[str, Any]:
    spec = record.spec
    if record.failed is not None:
        return {"failed": True, "log_tail": record.failed, "wall_s": record.wall_s}
    trained = sum(record.batches_trained.values())
    merged = sum(record.batches_merged.values())
    stop = spec.time_s
    before = [c for c in record.curve if c["t_s"] <= stop] or record.curve[:1]
    commits = sorted(t for t in record.commit_times_s if t <= stop)
    gaps = [b - a for a, b in zip(commits, commits[1:])] + ([stop - commits[-1]] if commits else [])
    others = [n for n in spec.names if n != spec.slow]
    outer_steps = trained / record.period
    return {
        "failed": False,
        "goodput": round(merged / trained, 4) if trained else None,
        "tokens_per_s": round((tokens_at(record, stop) - tokens_at(record, 0.0)) / stop, 1),
        "others_tokens_per_s": round(sum(record.steps_per_s.get(n, 0.0) for n in others) * record.tokens_per_step, 1),
        "eval_loss": round(before[-1]["eval_loss"], 4) if before else None,
        "eval_loss_final": round(record.curve[-1]["eval_loss"], 4) if record.curve else None,
        "longest_stall_s": round(max(gaps), 2) if gaps else float(stop),
        "bytes_per_outer_step": round(record.bytes_sent / outer_steps) if outer_steps else None,
        "vmhwm_mib_max": round(max(record.supervised.vmhwm_mib.values(), default=0.0), 1),
        "vmhwm_mib": {k: round(v, 1) for k, v in record.supervised.vmhwm_mib.items()},
        "tokens_trained": trained * record.tokens_per_step,
        "tokens_merged": merged * record.tokens_per_step,
        "work_lost_tokens": (trained - merged) * record.tokens_per_step,
        "commits": len(record.commit_times_s),
        "start_to_first_step_s": record.start_to_step_s,
        "kills": record.supervised.kills,
        "restarts": record.supervised.restarts,
        "wall_s": record.wall_s,
        "curve": [{"t_s": c["t_s"], "tokens": round(tokens_at(record, c["t_s"])), "eval_loss": round(c["eval_loss"], 4)}
                  for c in record.curve],
    }


def loss_at_tokens(curve: list[dict[str, Any]], tokens: float) -> float | None:
    """The eval loss where a curve reaches ``tokens`` (linear between its points)."""
    points = sorted((c["tokens"], c["eval_loss"]) for c in curve)
    for (k1, l1), (k2, l2) in zip(points, points[1:]):
        if k1 <= tokens <= k2:
            return l1 if k2 == k1 else l1 + (l2 - l1) * (tokens - k1) / (k2 - k1)
    return None


PAIRS = ((System.DDILOCO, System.TORCHFT_DILOCO), ("ddiloco_dp", System.TORCHFT_DDP))
RATIO_METRICS = ("goodput", "tokens_per_s", "others_tokens_per_s", "eval_loss", "longest_stall_s",
                 "bytes_per_outer_step", "vmhwm_mib_max")


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per scenario, ddiloco/torchft for every metric both have (and eval loss at equal tokens, fault-free)."""
    out: dict[str, dict[str, Any]] = {}
    for scenario, systems in results.items():
        ours, theirs = systems.get(System.DDILOCO.value), systems.get(System.TORCHFT_DILOCO.value)
        if not ours or not theirs or ours.get("failed") or theirs.get("failed"):
            continue
        row = {m: _ratio(ours.get(m), theirs.get(m)) for m in RATIO_METRICS}
        if scenario == Scenario.FAULT_FREE:
            tokens = min(ours["curve"][-1]["tokens"], theirs["curve"][-1]["tokens"])
            a, b = loss_at_tokens(ours["curve"], tokens), loss_at_tokens(theirs["curve"], tokens)
            row["eval_loss_at_equal_tokens"] = {"tokens": tokens, "ddiloco": _round(a), "torchft_diloco": _round(b),
                                                "ratio": _ratio(a, b)}
        out[scenario] = row
    return out


def targets(results: dict[str, dict[str, Any]], spread: dict[str, list[float]]) -> dict[str, Any]:
    """The issue's targets, each with the measured figures and whether it was met (None: not measured)."""
    def pair(scenario: Scenario) -> tuple[dict[str, Any], dict[str, Any]] | None:
        s = results.get(scenario.value, {})
        a, b = s.get(System.DDILOCO.value), s.get(System.TORCHFT_DILOCO.value)
        if not a or not b or a.get("failed") or b.get("failed"):
            return None
        return None if any(x.get(k) is None for x in (a, b) for k in RATIO_METRICS if k != "others_tokens_per_s") \
            else (a, b)

    out: dict[str, Any] = {}
    kills, slow, free = pair(Scenario.KILLS), pair(Scenario.SLOW_LEARNER), pair(Scenario.FAULT_FREE)
    if kills:
        a, b = kills
        out["kills_goodput_plus_10_points"] = _target(a["goodput"] - b["goodput"] >= 0.10,
                                                      f"{a['goodput']:.3f} vs {b['goodput']:.3f}")
        out["kills_stall_at_most_half"] = _target(a["longest_stall_s"] <= 0.5 * b["longest_stall_s"],
                                                  f"{a['longest_stall_s']}s vs {b['longest_stall_s']}s")
        out["kills_eval_loss_not_above"] = _target(a["eval_loss"] <= b["eval_loss"],
                                                   f"{a['eval_loss']} vs {b['eval_loss']}")
    if slow:
        a, b = slow
        out["slow_others_tokens_per_s_1_5x"] = _target(a["others_tokens_per_s"] >= 1.5 * b["others_tokens_per_s"],
                                                       f"{a['others_tokens_per_s']} vs {b['others_tokens_per_s']}")
    if free:
        a, b = free
        out["fault_free_tokens_per_s_0_95x"] = _target(a["tokens_per_s"] >= 0.95 * b["tokens_per_s"],
                                                       f"{a['tokens_per_s']} vs {b['tokens_per_s']}")
        out["fault_free_bytes_at_most_quarter"] = _target(
            a["bytes_per_outer_step"] <= 0.25 * b["bytes_per_outer_step"],
            f"{a['bytes_per_outer_step']} vs {b['bytes_per_outer_step']} B")
        ours, theirs = spread.get(System.DDILOCO.value, []), spread.get(System.TORCHFT_DILOCO.value, [])
        if len(theirs) >= 2 and ours:
            lo, hi = min(theirs), max(theirs)
            mid = statistics.median(ours)
            out["fault_free_loss_at_equal_tokens_in_spread"] = _target(
                lo <= mid <= hi, f"ddiloco median {mid:.4f} vs torchft {lo:.4f}..{hi:.4f} over {len(theirs)} seeds")
        else:
            out["fault_free_loss_at_equal_tokens_in_spread"] = _target(None, "one seed: no spread measured (--seeds)")
    return out


def table(results: dict[str, dict[str, Any]], rows: dict[str, dict[str, Any]]) -> str:
    """One line per scenario and metric: ddiloco, torchft, ddiloco/torchft; then data parallel's pair."""
    lines = [f"{'scenario':<13} {'metric':<26} {'ddiloco':>12} {'torchft':>12} {'ratio':>7}"]
    for scenario, systems in results.items():
        for ours_name, theirs_name in PAIRS:
            ours, theirs = systems.get(str(ours_name)), systems.get(str(theirs_name))
            if not ours and not theirs:
                continue
            label = scenario if ours_name == System.DDILOCO else f"{scenario} (dp)"
            for name, side in ((ours_name, ours), (theirs_name, theirs)):
                if side and side.get("failed"):
                    lines.append(f"{label:<13} {str(name) + ' FAILED':<26} (log tail in the JSON)")
            metrics_shown = RATIO_METRICS if ours_name == System.DDILOCO else ("tokens_per_s", "eval_loss")
            for m in metrics_shown:
                a = None if not ours or ours.get("failed") else ours.get(m)
                b = None if not theirs or theirs.get("failed") else theirs.get(m)
                if a is None and b is None:
                    continue
                lines.append(f"{label:<13} {m:<26} {_fmt(a):>12} {_fmt(b):>12} {_fmt(_ratio(a, b)):>7}")
        eq = rows.get(scenario, {}).get("eval_loss_at_equal_tokens")
        if eq:
            lines.append(f"{scenario:<13} {'eval_loss @ ' + format(eq['tokens'], ',') + ' tok':<26} "
                         f"{_fmt(eq['ddiloco']):>12} {_fmt(eq['torchft_diloco']):>12} {_fmt(eq['ratio']):>7}")
    return "\n".join(lines)


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    """Eval loss against wall time, one panel per scenario, a line per system, each kill a tick at the bottom."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = [s for s in results if any(not r.get("failed") for r in results[s].values() if isinstance(r, dict))]
    fig, axes = plt.subplots(1, max(1, len(scenarios)), figsize=(5.2 * max(1, len(scenarios)), 4.2), squeeze=False)
    colours = {"ddiloco": "tab:blue", "torchft_diloco": "tab:red", "torchft_ddp": "tab:orange"}
    for ax, scenario in zip(axes[0], scenarios):
        for system, r in results[scenario].items():
            if system not in colours or r.get("failed") or not r.get("curve"):
                continue
            ax.plot([c["t_s"] for c in r["curve"]], [c["eval_loss"] for c in r["curve"]], color=colours[system],
                    label=system, marker=".", markersize=3)
            for k, (t, _) in enumerate(r.get("kills", [])):
                ax.axvline(t, color=colours[system], alpha=0.35, linestyle=":",
                           label=f"{system} kill -9" if k == 0 else None)
        ax.set_title(scenario)
        ax.set_xlabel("wall time since the learners started (s)")
        ax.set_ylabel("eval loss (nats/byte)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _target(met: bool | None, figures: str) -> dict[str, Any]:
    return {"met": met, "figures": figures}


def _ratio(a: Any, b: Any) -> float | None:
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or not b:
        return None
    return round(a / b, 3)


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and abs(x) < 100:
        return f"{x:.3f}"
    return f"{x:,.0f}" if isinstance(x, (int, float)) else str(x)
