"""Read-only views of a running virtual cluster, for whoever watches it (the live view).

:func:`take_snapshot` reads the nodes, the synchronizers' versions, the accounting and the
timeline, and copies what it needs into frozen values; it draws no random number and
changes no state, so a run watched by a terminal trains the same weights as one that is
not. How a learner's state is named here is a reading of its process and its core's phase,
never a decision.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Sequence

from ddiloco.core.learner_side.learner_phase import LearnerPhase, LoopMove
from ddiloco.sim.harness import Recorder
from ddiloco.sim.learner_node import LearnerNode
from ddiloco.sim.timeline import Happening, Timeline


class LearnerState(enum.StrEnum):
    LATE = "late"
    """Not started yet: it joins the run under way later (``cluster.late_learners``)."""
    JOINING = "joining"
    """Started, waiting for its first global state."""
    TRAINING = "training"
    WAITING = "waiting"
    """Holds a state but may not step: it waits for an update (synchronous DiLoCo)."""
    DOWN = "down"
    """The process is dead (failure trace); it restarts when its outage ends."""
    REJOINING = "rejoining"
    """Restarted, or lost its session: asking for the global state again."""
    FROZEN = "frozen"
    """Alive but stopped (the adversary's freeze)."""
    STOPPED = "stopped"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class LearnerView:
    name: str
    state: LearnerState
    slow: bool
    """On the slower hardware generation (``cluster.slow_fraction``)."""
    steps: int
    """Inner steps over all its boots."""
    failures: int
    rejoined_at_s: float | None
    """When it last held the global state again after a restart or a lost session."""


@dataclass(frozen=True, slots=True)
class ClusterSnapshot:
    time_s: float
    fraction_done: float
    tokens: int
    versions: tuple[int, ...]
    """The global model's version of each fragment."""
    learners: tuple[LearnerView, ...]
    goodput: float
    """Work credited so far over provisioned chip-time (credits arrive at merges, so it lags)."""
    eval_loss: float
    """The latest evaluation of the global model ..."""
    eval_at_s: float
    """... and when it was taken."""
    failures: int
    rejoins: int
    merges: int


SnapshotFn = Callable[[ClusterSnapshot], None]
"""Called with a fresh snapshot every so often (virtual time) and at the end of the run."""


def learner_state(node: LearnerNode, now: float) -> LearnerState:
    if not node.up:
        return LearnerState.LATE if now < node.arrives_s else LearnerState.DOWN
    if now < node.frozen_until_s:
        return LearnerState.FROZEN
    core = node.core
    if core.phase in (LearnerPhase.STOPPING, LearnerPhase.STOPPED):
        return LearnerState.STOPPED
    if core.phase is LearnerPhase.FAILED:
        return LearnerState.FAILED
    if not core.joined or core.rejoining():
        return LearnerState.REJOINING if node.boot or core.joined else LearnerState.JOINING
    if not node.stepping and core.between_steps(now) is LoopMove.WAIT:
        return LearnerState.WAITING
    return LearnerState.TRAINING


def take_snapshot(now: float, tokens: int, versions: Sequence[int], learners: Sequence[LearnerNode],
                  recorder: Recorder, timeline: Timeline) -> ClusterSnapshot:
    """What a virtual cluster's parts say at ``now`` (the cluster passes them; nothing is changed)."""
    latest = recorder.rows[-1]
    return ClusterSnapshot(
        time_s=now,
        fraction_done=recorder.fraction_done(tokens, now),
        tokens=tokens,
        versions=tuple(versions),
        learners=tuple(
            LearnerView(node.name, learner_state(node, now), recorder.timer.slow[node.index],
                        node.step_offset + node.core.step, timeline.of(Happening.FAILURE, node.index),
                        timeline.last(Happening.REJOINED, node.index))
            for node in learners
        ),
        goodput=recorder.accounting.goodput(now),
        eval_loss=latest["eval_loss"],
        eval_at_s=latest["virtual_time_s"],
        failures=timeline.counts[Happening.FAILURE],
        rejoins=timeline.counts[Happening.REJOINED],
        merges=timeline.counts[Happening.MERGE],
    )
