"""What a node of the virtual cluster may ask of the cluster that drives it.

Nodes (:mod:`ddiloco.sim.learner_node`, :mod:`ddiloco.sim.sync_node`) carry out their core's
actions through this and nothing else: the clock and its queue, the invariant checker, the
links, and the run's bookkeeping (tokens, accounting, evaluations, the timeline), which stays
the cluster's. The cluster implements it (and so does the simulator driver of
``tests/test_drivers_agree.py``, for the parts a synchronizer node uses).
"""

from __future__ import annotations

from typing import Protocol

import torch

from ddiloco.core.shared.actions import RoundClosed
from ddiloco.core.shared.messages import FragmentUpdate, StopNotice
from ddiloco.sim.events import AtLearner, EventQueue
from ddiloco.sim.invariants import InvariantChecker


class NodeHost(Protocol):
    queue: EventQueue
    checker: InvariantChecker | None

    def new_call_id(self) -> int: ...

    def call_deadline_s(self, nbytes: int) -> float:
        """How long a caller waits for a call that carries ``nbytes`` both ways
        (:func:`~ddiloco.core.shared.deadlines.call_deadline_s` on this cluster's link)."""

    def send_up(self, learner: str, fragment: int, payload_bytes: int) -> list[float]:
        """A learner's message to the synchronizer: when (and how often) it arrives."""

    def uploads_stall(self, learner: str) -> bool:
        """Do ``learner``'s uploads stall after their header now (the adversary's stall)?"""

    def send_header(self, learner: str, fragment: int) -> float | None:
        """A stalled upload's header to the synchronizer: when it arrives (None: lost)."""

    def push(self, event: AtLearner, fragment: int, payload_bytes: int) -> float | None:
        """Send ``event`` down to its learner process; returns its first arrival (None: lost)."""

    def push_to(self, learner: str, fragment: int, payload_bytes: int,
                message: FragmentUpdate | StopNotice) -> float | None:
        """A message on ``learner``'s update stream (its current process); None: lost, or cut
        because its transfer outlasts :func:`~ddiloco.core.shared.deadlines.stream_deadline_s`."""

    def left_at(self, learner: str) -> float:
        """When the last message pushed to ``learner`` has left: its transfer over the learner's
        link done, its latency still ahead (what a stream's write on a real link waits for)."""

    def process_up(self, m: int, boot: int) -> bool:
        """Is learner ``m``'s process ``boot`` still running?"""

    def on_round(self, record: RoundClosed, value: torch.Tensor) -> None:
        """A synchronizer merged a round (invariants, credits, the timeline)."""

    def step_time_s(self, m: int) -> float:
        """How long learner ``m``'s next inner step takes (its hardware, jitter)."""

    def run_progress(self) -> float:
        """The run's progress in [0, 1] (the inner learning-rate schedule's position)."""

    def on_step(self, m: int, tokens: int, step: int, started_s: float, batch: int) -> None:
        """Learner ``m`` finished its ``step``-th inner step (counted across its boots) on batch ``batch`` of its data."""

    def on_resume(self, m: int, batch: int) -> None:
        """A process of learner ``m`` is about to train its first step, on batch ``batch`` of its data."""

    def after_step(self) -> None:
        """After a step's actions: evaluate the global model if one is due."""

    def on_ready(self, m: int, rejoined: bool) -> None:
        """Learner ``m`` holds the global state from every shard (joined, or rejoined)."""

    def reset_links(self, learner: str) -> None:
        """A restarted process: its links start empty."""
