"""The warnings a learner's link says for the core's actions about its own health (starved,
behind, stale, an outage): the lines an operator looks for when a learner's work does not reach the model."""

from __future__ import annotations

import logging

from ddiloco.core.shared.actions import Behind, LearnerAction, Outage, OutagePhase, Stale, Starved
from ddiloco.core.shared.messages import Contribution, Request
from ddiloco.core.sync_side.refusals import RefusalKind, kind_of
from ddiloco.runtime.learner.repeats import Repeats

log = logging.getLogger("ddiloco.learner")


def say_refusal(repeats: Repeats, request: Request, reason: str, shard: int, detail: str) -> None:
    """A refusal, once per reason and then summarized: a warning when it threw work away (its kind,
    ``core/sync_side/refusals.py``), the line a user sees without configuring logging (issue 57: an
    honest learner's work was refused and only the synchronizer's log said so); else information."""
    if isinstance(request, Contribution) and kind_of(reason) is not RefusalKind.RESENT:
        repeats.say(reason, "the synchronizer refused this learner's contribution of fragment %d (%d steps, "
                    "%d tokens; shard %d): %s: %s; that work is lost, training goes on", request.fragment,
                    request.steps, request.tokens, shard, reason, detail, level=logging.WARNING)
    else:
        repeats.say(reason, "%s refused by shard %d: %s", type(request).__name__, shard, detail)


def say_warning(action: LearnerAction, backlog: int) -> None:
    """One warning for a Starved, Stale or Behind action (``backlog``: contributions waiting)."""
    if isinstance(action, Starved):
        log.warning("none of this learner's work has reached the synchronizer in its last %d steps, although "
                    "it answers: its link is too slow for the protocol (%d contributions waiting)",
                    action.steps, backlog)
    elif isinstance(action, Stale):
        log.warning("this learner's contributions arrive stale: fragment %d, measured from version %d, was "
                    "refused although updates reach it in order (it holds version %d by now): its link's "
                    "round trip spans more rounds than the synchronizer merges late work from "
                    "(protocol.staleness_max x protocol.staleness_reach), for longer than it takes for a "
                    "delay (protocol.staleness_leases x protocol.lease_s). It trains on, following the "
                    "global model, without registering again; its own work is merged again once the link "
                    "is faster or the rounds slower: protocol.period = %d would fit",
                    action.fragment, action.base_version, action.held_version, action.period_fits)
    elif isinstance(action, Behind):
        log.warning("%s", action.describe())


def say_outage(outage: Outage, address: str, error: str) -> None:
    """One line when the shard stops answering, a summary at intervals, one line when it is back
    (``error``: why its last call went unanswered)."""
    where = f"the synchronizer at {address} (shard {outage.shard})"
    if outage.phase is OutagePhase.ENDED:
        log.warning("%s answers again after %.0f s%s", where, outage.for_s,
                    f"; {outage.folded} contributions were folded into later ones" if outage.joined else "")
    elif not outage.joined:
        log.warning("no answer from %s for %.0f s (%s): is it running, and is this its gRPC port (not the status "
                    "page's)? Still trying", where, outage.for_s, error)
    elif outage.phase is OutagePhase.BEGAN:
        log.warning("%s does not answer (%s): training goes on, contributions are folded into later ones until "
                    "it is back", where, error)
    else:
        log.warning("%s unreachable for %.0f s; %d contributions folded so far, training goes on", where,
                    outage.for_s, outage.folded)
