"""The synchronizer's intake of a sharded learner's slices (the part of
:class:`~ddiloco.core.sync_side.synchronizer.Synchronizer` that holds them, ``core/sync_side/slice_assembly.py``).

A slice is checked as far as it can be alone — the session, the fragment, its sequence number and
base version — and held; the contribution its siblings complete goes down the synchronizer's
ordinary path once, so a sharded learner is admitted, counted and weighed as one learner.
"""

from __future__ import annotations

from collections.abc import Callable

from ddiloco.core.shared.actions import Accepted, SyncAction
from ddiloco.core.shared.codecs import Codec
from ddiloco.core.shared.messages import Contribution, Rejected, RejectReason
from ddiloco.core.shared.protocol_config import ProtocolConfig
from ddiloco.core.shared.staleness import StalenessBound
from ddiloco.core.sync_side.registry import Registry
from ddiloco.core.sync_side.rounds import GlobalFragment
from ddiloco.core.sync_side.run_state import RunPhase, RunState
from ddiloco.core.sync_side.slice_assembly import SliceAssembler
from ddiloco.core.sync_side.status_snapshot import SyncCounters


class SliceIntake:
    config: ProtocolConfig
    _registry: Registry
    _counters: SyncCounters
    _run: RunState
    _uplink: Codec
    _staleness: StalenessBound
    _slices: SliceAssembler
    _stopping: bool

    _fragment: Callable[[Contribution], GlobalFragment]
    """The fragment ``c`` names, or :class:`Rejected` (``unknown_fragment``)."""
    _contribute: Callable[[Contribution, float], list[SyncAction]]
    """The ordinary path of a whole contribution."""

    def _contribute_slice(self, c: Contribution, now: float) -> list[SyncAction]:
        """One rank's slice: held until its siblings are in, then the whole goes through ``_contribute``
        once; the slice that completed it gets the verdict on the whole, the others were accepted."""
        if self._run.phase is RunPhase.FINISHED:
            raise Rejected(RejectReason.FINISHED, "the run is over")
        rec = self._registry.check(c.learner_id, c.session, None if c.progress is None else c.progress.boot)
        frag = self._fragment(c)
        if c.seq <= rec.last_seq.get(c.fragment, -1):
            raise Rejected(RejectReason.DUPLICATE, f"seq {c.seq} of fragment {c.fragment} was taken already")
        frag.check_version(c.base_version, self._staleness, now, c.learner_id)
        whole, ended = self._slices.add(c, frag.value.numel(), self._uplink)
        self._slices_lost(ended)
        if whole is None:
            self._registry.renew(rec, now)
            return [Accepted(c.learner_id, c, stop=self._stopping)]
        return [Accepted(c.learner_id, c, stop=self._stopping), *self._contribute(whole, now)[1:]]

    def _slices_lost(self, lost: list[Contribution]) -> None:
        """Sets of slices that will never be complete: their work counted as refused (``slice_incomplete``)."""
        for c in lost:
            err = Rejected(RejectReason.SLICE_INCOMPLETE, "a rank's slice never came")
            self._counters.refused(c, err)
            self._registry.refused(c, err)
