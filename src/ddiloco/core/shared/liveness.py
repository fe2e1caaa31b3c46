"""How long the protocol may take to make progress: the bounds both fault tools check.

``ddiloco chaos`` (real processes) and ``ddiloco simtest`` (the virtual cluster) each check a
liveness property against a bound, and each bound is defined here, once. They bound two
different things, because the two tools watch different things:

- **pause**: while learners train and the synchronizer answers, no fragment goes longer than
  :func:`pause_bound_s` without a merge. A round waits for a dead learner at most until its
  lease expires (then the effective quorum drops), and for stragglers at most one grace
  window. ``ddiloco chaos`` reads its pauses from the synchronizer's status. The premise is
  that enough learners stay healthy to meet the quorum: faults that take every learner out at
  once (with quorum 1, one frozen, one cut off and the third still joining again after a
  synchronizer's restart) stop merges for as long as they last, which no bound on the protocol
  covers; the seeded schedules keep one learner healthy at all times, and so does the CI's.
- **catch-up**: once the last fault has ended, every learner that is up trains in the
  synchronizer's current incarnation, holding every fragment at least at the version the
  synchronizer had then, within :func:`catch_up_bound_s`. ``ddiloco simtest`` sees every
  learner's state, so it can check this; chaos sees only the synchronizer's status.
"""

from __future__ import annotations

from ddiloco.core.shared.protocol_config import ProtocolConfig


def pause_bound_s(protocol: ProtocolConfig, grace_window_s: float) -> float:
    """The longest a fragment may go without a merge while learners train: one lease (a dead
    learner stops holding the round) plus ``grace_window_s``, the largest grace window seen."""
    return grace_window_s + protocol.lease_s


def catch_up_bound_s(protocol: ProtocolConfig, *, rpc_timeout_s: float, slowest_step_s: float) -> float:
    """B: from the end of the last fault until every learner that is up is back in step:
    ``3·lease + 2·rpc_timeout + (H + τ + 2)·slowest_step + max_wait`` (``rpc_timeout_s``: the
    driver's deadline of one call; ``slowest_step_s``: the slowest learner's inner step)."""
    p = protocol
    return 3 * p.lease_s + 2 * rpc_timeout_s + (p.period + p.overlap + 2) * slowest_step_s + p.max_wait_s
