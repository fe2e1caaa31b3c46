"""The behaviour fingerprint: one short string for the protocol decisions of a fixed set of worlds.

A results file says which code it was measured on by its commit, but a commit does not say whether
the protocol decides what it decided then: fifty commits may move no decision, one rule change moves
many. The fingerprint runs a few seeded worlds on the virtual cluster (:data:`SCENARIOS`: failures
and a slow learner, late joiners, K = M, a sharded synchronizer, every fault kind of the adversary,
synchronous DiLoCo, the flood of abandoned joins) on the synthetic workload, and hashes what the protocol decided in
them: every round's fragment, version, close reason, quorum, live count and merged contributions
(learner, session, sequence number, tokens, steps, base version), when it closed (to the
microsecond of virtual time), the refusals by reason, the failures, rejoins and pauses, the bytes
each way, the steps each learner took and the final versions. Two trees with the same fingerprint
decide alike in these worlds; a rule change changes it.

What it cannot see: floats (eval losses, weights, coherence, goodput: the quickstart's weights hash
differs between CPUs while its decisions agree, and a decision that hinges on a float's last bits,
such as a norm clipped exactly at its bound, could too), the model and data (the synthetic walk
stands in for a transformer), and the real runtime's timing (threads, gRPC, the OS scheduler).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ddiloco.core.shared.actions import RoundClosed
from ddiloco.settings.config_sources import build_config
from ddiloco.sim.harness import Recorder
from ddiloco.sim.synthetic import SyntheticWorkload
from ddiloco.sim.virtual_cluster import VirtualCluster

DIGITS = 12
"""Hex digits of the fingerprint and of each scenario's hash."""


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    overrides: tuple[str, ...]
    """``--set`` assignments on the tiny preset (``run.tokens=0``: each runs on a time budget)."""


_BASE = ("run.tokens=0", "run.time_s=300")
SCENARIOS: tuple[Scenario, ...] = (
    Scenario("failures_and_a_slow_learner", (*_BASE, "run.learners=4", "run.seed=11", "faults.mtbf_s=40",
                                             "faults.downtime_s=8", "cluster.slow_fraction=0.25")),
    Scenario("late_joiners", (*_BASE, "run.learners=4", "run.seed=12", "cluster.late_learners=2",
                              "cluster.late_join_s=40")),
    Scenario("quorum_of_all", (*_BASE, "run.learners=3", "run.seed=13", "protocol.quorum=3", "faults.mtbf_s=60",
                               "faults.downtime_s=10", "cluster.jitter=0.2")),
    Scenario("sharded_synchronizer", (*_BASE, "run.learners=3", "run.seed=14", "protocol.fragments=4",
                                      "protocol.shards=2", "faults.mtbf_s=60", "faults.downtime_s=6")),
    Scenario("adversary", (*_BASE, "run.learners=4", "run.seed=15", "faults.loss=0.05", "faults.duplicate=0.05",
                           "faults.reorder=0.1", "faults.partition=0.01", "faults.freeze=0.005",
                           "faults.sync_crash=0.01", "faults.mtbf_s=80", "faults.downtime_s=10")),
    Scenario("synchronous_diloco", (*_BASE, "run.mode=diloco", "run.learners=3", "run.seed=17",
                                    "faults.mtbf_s=80", "faults.downtime_s=10")),
    Scenario("join_flood", (*_BASE, "run.learners=2", "run.seed=16", "faults.join_flood=0.05",
                            "faults.join_flood_s=30", "faults.join_flood_per_s=10", "faults.mtbf_s=30",
                            "faults.downtime_s=5")),
)


class _DecisionLog(VirtualCluster):
    """The virtual cluster, writing down every round it closes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rounds: list[list[Any]] = []

    def on_round(self, record: RoundClosed, value: torch.Tensor) -> None:
        self.rounds.append([record.fragment, record.version, str(record.reason), record.quorum_required,
                            record.alive, round(record.closed_at_s, 6),
                            [[m.learner_id, m.session, m.seq, m.tokens, m.steps, m.base_version]
                             for m in record.merged]])
        super().on_round(record, value)


def decisions(scenario: Scenario) -> dict[str, Any]:
    """What the protocol decided in one scenario (no floats but virtual times to the microsecond)."""
    torch.set_num_threads(1)
    config = build_config(preset="tiny", overrides=scenario.overrides)
    workload = SyntheticWorkload(config)
    cluster = _DecisionLog(workload, Recorder(config, workload))  # type: ignore[arg-type]
    result = cluster.run()
    events = result["events"]
    return {
        "rounds": cluster.rounds,
        "rejections": result["rejections"],
        "refused_steps": result["refused_steps"],
        "norms_clipped": result["norms_clipped"],
        "steps": result["steps_per_learner"],
        "events": {key: events[key] for key in ("failures", "rejoins", "merges", "outages", "rejoined_at")}
                  | {"longest_pause_s": round(events["longest_pause_s"], 6)},
        "bytes": [result["final"]["bytes_up"], result["final"]["bytes_down"]],
        "versions": result["fragment_versions"],
        "faults": result["faults"],
    }


def digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:DIGITS]


def fingerprint(progress: Callable[[Scenario], None] | None = None) -> tuple[str, dict[str, str]]:
    """The tree's fingerprint, and each scenario's hash (which worlds a change moved)."""
    parts: dict[str, str] = {}
    for scenario in SCENARIOS:
        parts[scenario.name] = digest(decisions(scenario))
        if progress is not None:
            progress(scenario)
    return digest(parts), parts
