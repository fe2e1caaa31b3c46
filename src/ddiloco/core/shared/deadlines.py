"""How long every call and every stream may take: each deadline defined once, for both drivers.

A call has a caller who waits and a synchronizer that answers; the rules of each side are
here, and a driver supplies only what its world knows.

- **The caller** (:func:`call_deadline_s`) waits for an answer within ``answer_s`` of its
  :class:`LinkExpectation`, plus the bytes the call carries either way at its ``bytes_per_s``:
  a contribution its payload, a join the state it brings back (:func:`join_state_bytes`), a
  heartbeat or a leave nothing.
  Where the worlds differ is the link: the simulator knows its virtual link exactly
  (``cluster.rpc_timeout_s``, ``cluster.bandwidth_bps``), a real learner cannot know its own, so
  it assumes one: :data:`CLIENT_UPLOAD_LINK` for an upload (a contribution given up on is
  folded into the next one, so waiting on a slow link gains nothing) and
  :func:`client_join_link` for a join (a join cannot be folded: any link the run admits,
  down to ``protocol.min_link_bytes_per_s``, must be able to join).
- **The synchronizer** holds every message it sends on a stream (an update, a replay after a
  resubscription, a chunk of a join's state) to :func:`stream_deadline_s`, and a whole join's
  state transfer to the core's admission window, :func:`admission_window_s`: the lease of a
  joining learner waits :func:`admission_s` for its state, then runs one lease, so a transfer
  still going after that delivers a state to a session that has already expired. An upload's
  messages are paced by :func:`upload_pace_s`. All of these allow the slowest link the run is
  configured for, ``protocol.min_link_bytes_per_s``: a floor that protects the synchronizer's
  memory and slots from slow or stalling members, far below what a learner expects of its link.
  The simulator's virtual streams never wait for their reader, so only a message whose own
  transfer on a virtual link slower than that floor outlasts its deadline is ever cut there.
- **A stop** (SIGTERM, SIGINT): the synchronizer ends within :func:`stop_deadline_s`, whatever state
  its callers and streams are in: calls in flight get :data:`STOP_CALLS_S`, then every wait of the
  shutdown (the final checkpoint, the streams' last sends, the round log's last fsync) shares what is
  left of the bound, and one that runs out is given up in one line.
- **A starved link**: a learner whose work has not been accepted for a while although the
  synchronizer answers. The learner judges itself in steps (:func:`starved`), the synchronizer
  judges it in time (:func:`starved_after_s`): one rule, both forms here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ddiloco.core.shared.protocol_config import ProtocolConfig

if TYPE_CHECKING:  # a configuration's deadlines are checked without torch (the fragments' module imports it)
    from ddiloco.core.shared.fragments import FragmentPlan

STATE_VALUE_BYTES = 4
"""A join sends the global state in fp32."""
STREAM_SLACK_LEASES = 3.0
"""What every message a synchronizer sends is allowed on top of its bytes at the floor, in leases."""
CLIENT_ANSWER_S = 10.0
"""A real learner's wait for the synchronizer's answer to start (every call's fixed part)."""
CLIENT_UPLOAD_BYTES_PER_S = 1e6
"""The throughput a real learner expects of its uplink for a contribution."""
CLIENT_FETCH_S = 300.0
"""A state fetch (evaluation, operators): its caller does not know the state's size beforehand."""
HOLD_LEASES = 1.0
"""How long a learner's next send of a fragment waits for the update of its last one. A round closes
within about a lease of a contribution (its grace window is shorter, and a learner that died
counts toward the quorum until its lease ends), so an update later than that was most likely lost.
The send then goes; if the synchronizer merged the last one it refuses this one as ``repeated``
and the learner waits a heartbeat interval more, then joins again (the state brings the update it
missed). Too short a wait costs that refusal, never a Δ merged twice; too long a wait holds the
fragment back after a lost update (with K = M every round waits on it)."""
DRAIN_LEASES = 2.0
"""After the run's stop, how long the synchronizer waits for learners to flush and leave, in leases:
a learner that heard the stop at its last heartbeat has one lease to send its last work, and the
send one more lease to arrive."""

STOP_CALLS_S = 1.0
"""At a stop, how long calls in flight get to end by themselves before they are cancelled."""
STOP_FIXED_S = 10.0
"""What a stop may take besides writing the state: the core's last event, the streams' last sends,
the round log's last fsync, the threads' ends."""
STOP_DISK_BYTES_PER_S = 50e6
"""The slowest disk a final checkpoint is given time for. It writes Θ and the outer momentum, twice
the state a join sends (8 bytes a parameter): next to nothing for the presets, 160 s for 1B parameters;
a synchronizer of up to 100M parameters stops within the 30 s that Slurm (``KillWait``) and Kubernetes
(``terminationGracePeriodSeconds``) give by default."""


def stop_deadline_s(state_bytes: int) -> float:
    """How long a synchronizer holding ``state_bytes`` of global state (fp32 Θ) may take to stop."""
    return STOP_CALLS_S + STOP_FIXED_S + 2 * state_bytes / STOP_DISK_BYTES_PER_S


@dataclass(frozen=True, slots=True)
class LinkExpectation:
    """What a caller expects of its link to the synchronizer."""

    answer_s: float
    """The answer starts within this."""
    bytes_per_s: float
    """The bytes flow at least this fast."""


CLIENT_UPLOAD_LINK = LinkExpectation(CLIENT_ANSWER_S, CLIENT_UPLOAD_BYTES_PER_S)
"""What a real learner's client expects for a contribution and for calls that carry nothing."""


def drain_after_stop_s(protocol: ProtocolConfig) -> float:
    """How long a stopped run waits for its learners' last work before the last merge."""
    return DRAIN_LEASES * protocol.lease_s


def client_join_link(protocol: ProtocolConfig) -> LinkExpectation:
    """What a real learner's client expects for a join: the slowest link the run admits."""
    return LinkExpectation(CLIENT_ANSWER_S, protocol.min_link_bytes_per_s)


def call_deadline_s(nbytes: int, link: LinkExpectation) -> float:
    """How long a caller waits for a call that carries ``nbytes`` (request and reply together)."""
    return link.answer_s + nbytes / link.bytes_per_s


def state_bytes_of(numels: Iterable[int]) -> int:
    """The size of the global state of fragments of these sizes, as a join sends it."""
    return STATE_VALUE_BYTES * sum(numels)


def join_state_bytes(plan: FragmentPlan, protocol: ProtocolConfig, shard: int) -> int:
    """What a join to ``shard`` brings back: the state of the fragments it owns (its synchronizer's
    ``state_bytes``)."""
    return state_bytes_of(f.numel for f in plan.fragments if protocol.shard_of(f.index) == shard)


def stream_deadline_s(nbytes: int, protocol: ProtocolConfig) -> float:
    """How long one message of ``nbytes`` a synchronizer sends on a stream may take to leave."""
    return STREAM_SLACK_LEASES * protocol.lease_s + nbytes / protocol.min_link_bytes_per_s


def upload_pace_s(received_bytes: int, next_max_bytes: int, protocol: ProtocolConfig) -> float:
    """By when, counted from an upload's start, its next message must have arrived: the header
    within a lease, every later one (of at most ``next_max_bytes``) by when a sender at the floor
    that started a lease late would have delivered it whole."""
    if not received_bytes:
        return protocol.lease_s
    return protocol.lease_s + (received_bytes + next_max_bytes) / protocol.min_link_bytes_per_s


def admission_s(state_bytes: int, protocol: ProtocolConfig) -> float:
    """How long a joining learner's lease waits for its state before it starts to run: the state
    at the floor (it sends as fast as the link allows)."""
    return state_bytes / protocol.min_link_bytes_per_s


def admission_window_s(state_bytes: int, protocol: ProtocolConfig) -> float:
    """How long a joining session lives without its state arriving (the wait, then one lease):
    also how long the synchronizer lets the state's transfer take."""
    return admission_s(state_bytes, protocol) + protocol.lease_s


STARVED_PERIODS = 3
"""None of a live learner's work accepted for this many of its periods ..."""
STARVED_LEASES = 2
"""... and this many leases: link-starved, as the learner sees it and as the synchronizer does
(``Registry``). The leases keep a learner that steps in milliseconds from calling its first
round trip a starved link."""


def starved(unaccepted_steps: int, unaccepted_s: float, period: int, lease_s: float) -> bool:
    """Link-starved, as a learner judges itself (``LinkWatch``): none of its work accepted for
    ``STARVED_PERIODS`` periods of steps and ``STARVED_LEASES`` leases."""
    return unaccepted_steps >= STARVED_PERIODS * period and unaccepted_s >= STARVED_LEASES * lease_s


def starved_after_s(lease_s: float, period: int, step_s: float) -> float:
    """The same rule in time, as the synchronizer judges a learner stepping every ``step_s``
    (``Registry``): how long after its last accepted work it is link-starved."""
    return max(STARVED_LEASES * lease_s, STARVED_PERIODS * period * step_s)
