"""What the synchronizer service keeps beside the core: its share of a checkpoint (its counters,
byte ledger and goodput, written with the core's state and restored with it), and what it makes
of the host's reports after every event (Prometheus metrics, goodput credit, the log's lines).
A part of :class:`~ddiloco.runtime.sync.service.SyncService` that records, kept apart from
the handlers that move bytes."""

from __future__ import annotations

import collections
import logging
import time
from typing import Any, Callable

from ddiloco.core.shared.actions import (
    Accepted,
    Admitted,
    Finished,
    LearnersForgotten,
    LeaseExpired,
    RoundClosed,
    StopLearners,
    SyncAction,
)
from ddiloco.core.shared.messages import FragmentUpdate, Leave
from ddiloco.core.shared.protocol_config import ProtocolConfig
from ddiloco.core.sync_side.status_snapshot import CoreView
from ddiloco.core.sync_side.synchronizer import Synchronizer
from ddiloco.measures.wire_bytes import ByteLedger
from ddiloco.runtime.sync.boundary import Boundary
from ddiloco.runtime.sync.checkpoint_writer import CheckpointWriter
from ddiloco.runtime.sync.metrics import GoodputMeter, ServiceMetrics
from ddiloco.runtime.sync.resume import changed_on_resume
from ddiloco.runtime.sync.round_log import LoggedRound
from ddiloco.settings.config import Config

log = logging.getLogger("ddiloco.sync")

FORGOTTEN = "(forgotten)"
"""The byte ledger's key for the traffic of learners the registry forgot."""


class ServiceRecords:
    """The host's observer (:class:`~ddiloco.runtime.sync.core_host.HostObserver`), given the
    pieces of the service it writes to; the service holds one and hands it to its host."""

    def __init__(self, config: Config, protocol: ProtocolConfig, *, incarnation: int, layout_sha256: str,
                 core: Synchronizer, boundary: Boundary, ledger: ByteLedger, goodput: GoodputMeter,
                 metrics: ServiceMetrics, writer: CheckpointWriter, share: list[float],
                 view: Callable[[], CoreView]) -> None:
        self.config = config
        self.protocol = protocol
        self.incarnation = incarnation
        self.layout_sha256 = layout_sha256
        self.core = core
        self.boundary = boundary
        self.ledger = ledger
        self.goodput = goodput
        self.metrics = metrics
        self.writer = writer
        self.share = share
        """Each fragment's share of the parameters: what a merged contribution to it credits."""
        self.view = view
        """What the core's thread published after its latest event."""
        self.joined: set[str] = set()
        """Learners this process admitted before: their next joins are logged as rejoins."""

    # ---- checkpoints ---------------------------------------------------------------------

    def restore(self, saved: dict[str, Any]) -> None:
        """Restore the core and the service's counters from a checkpoint (before serving)."""
        self.core.load_state_dict(saved["core"])
        service = saved["service"]
        changed = changed_on_resume(service.get("config", {}), self.config.to_dict())
        if changed:
            log.warning("resuming the run with %s", ", ".join(changed))
        self.boundary.known = {rec.learner_id for rec in self.core.status().learners}
        self.boundary.rejections = collections.Counter({k: int(v) for k, v in service["wire_rejections"].items()})
        self.boundary.learner_rejected = collections.Counter(
            {k: int(v) for k, v in service["learner_wire_rejected"].items()})
        self.ledger.load_state_dict(service["bytes"])
        self.goodput.load_state_dict(service["goodput"])

    def replay(self, r: LoggedRound) -> bool:
        update = FragmentUpdate(r.fragment, r.version, self.protocol.downlink_codec, r.payload, self.incarnation)
        return self.core.replay_round(update, plain=r.plain, reached=r.reached)

    def service_state(self) -> dict[str, Any]:
        return {
            "layout_sha256": self.layout_sha256,
            "wire_rejections": dict(self.boundary.rejections),
            "learner_wire_rejected": dict(self.boundary.learner_rejected),
            "bytes": self.ledger.state_dict(),
            "goodput": self.goodput.state_dict(time.monotonic()),
            "config": self.config.to_dict(),
        }

    def on_checkpoint(self, core_meta: dict[str, Any]) -> None:
        """The core asks for a checkpoint: write it in the background, a fragment at a time."""
        self.writer.submit(core_meta, self.service_state())

    # ---- what the host reports -------------------------------------------------------------

    def on_round(self, record: RoundClosed, elapsed_s: float) -> None:
        self.metrics.rounds.labels(str(record.reason)).inc()
        self.metrics.versions.labels(str(record.fragment)).set(record.version)
        if len(record.merged) >= 2:
            self.metrics.coherence.labels(str(record.fragment)).set(record.coherence)
        self.metrics.merge_seconds.observe(elapsed_s)
        for mc in record.merged:
            self.goodput.credit(mc.compute_s, self.share[record.fragment], mc.arrived_s)
        log.debug("fragment %d -> v%d (%s, %d contributions, %d of them late)", record.fragment, record.version,
                  record.reason, len(record.merged), record.late)

    def on_event(self, actions: list[SyncAction]) -> None:
        """Runs on the event loop after every event: reads only the actions and the published view."""
        view = self.view()
        self.metrics.alive.set(view.alive)
        left = {a.learner_id for a in actions if isinstance(a, Accepted) and isinstance(a.request, Leave)}
        for action in actions:
            if isinstance(action, Admitted):
                self.boundary.known.add(action.learner_id)
                self.goodput.joined(action.learner_id, time.monotonic())
            elif isinstance(action, LearnersForgotten):
                for name in action.learner_ids:
                    self.boundary.known.discard(name)
                    self.joined.discard(name)
                    self.ledger.rename(name, FORGOTTEN)
                    self.boundary.learner_rejected[FORGOTTEN] += self.boundary.learner_rejected.pop(name, 0)
            elif isinstance(action, StopLearners):
                self.goodput.finished(time.monotonic())  # the run's clock stops (core/sync_side/run_state.py): so does the chip-time
                log.info("budget spent: asking learners %s to flush and leave", ", ".join(action.recipients) or "-")
            elif isinstance(action, LeaseExpired) and action.learner_id not in left:  # a leave ends its lease too
                log.info("learner %s: lease expired", action.learner_id)
            elif isinstance(action, Finished):
                self.goodput.finished(time.monotonic())
                log.info("run finished: %d tokens, fragment versions %s", view.tokens, list(view.versions))
