"""The warnings a learner's link says for the core's actions about its own health (starved,
behind, stale): the lines an operator looks for when a learner's work does not reach the model."""

from __future__ import annotations

import logging

from ddiloco.core.actions import Behind, LearnerAction, Stale, Starved

log = logging.getLogger("ddiloco.learner")


def say_warning(action: LearnerAction, backlog: int) -> None:
    """One warning for a Starved, Stale or Behind action (``backlog``: contributions waiting)."""
    if isinstance(action, Starved):
        log.warning("none of this learner's work has reached the synchronizer in its last %d steps, although "
                    "it answers: its link is too slow for the protocol (%d contributions waiting)",
                    action.steps, backlog)
    elif isinstance(action, Stale):
        log.warning("this learner's contributions arrive stale: fragment %d, measured from version %d, was "
                    "refused although updates reach it in order (it holds version %d by now): its link's "
                    "round trip spans more rounds than protocol.staleness_max. It trains on, following the "
                    "global model, without registering again; its own work is merged again once the link "
                    "is faster or the rounds slower (a larger protocol.period or protocol.staleness_max)",
                    action.fragment, action.base_version, action.held_version)
    elif isinstance(action, Behind):
        log.warning("this learner's link carries %.0f%% of the contributions the protocol makes (each carried "
                    "%.1f steps, not H = %d): its work reaches the global model that much slower; the link "
                    "is too slow for this model and period (ddiloco bandwidth says what it needs)",
                    100 * action.share, action.steps_per_send, action.period)
