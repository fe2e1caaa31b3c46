"""Both drivers, the timing rules: the same contribution, join and resubscription get the same deadlines.

Every deadline is one function of ``core/shared/deadlines.py``; a driver supplies only its link. Here
the virtual cluster's link is set to what a real learner expects of its own (``cluster.rpc_timeout_s``
= ``CLIENT_ANSWER_S``, ``cluster.bandwidth_bps`` = 8 × ``CLIENT_UPLOAD_BYTES_PER_S``, and
``protocol.min_link_bytes_per_s`` the same rate, what the real client expects for a join), so
every deadline must come out the same in both drivers:

- the learner's: the simulator's ``CallTimeout`` for a call against the gRPC deadline the real
  client gives it (``LearnerNode`` and ``SyncClient``/``ShardChannel``, the drivers' own code);
- a join's state transfer: the core's admission window (the session expires without its
  state) against how long the real service lets the transfer run, and when the simulator's
  synchronizer gives a lost state up (when its caller does);
- a resubscription: every update the synchronizer replays is held to ``stream_deadline_s``
  of what it sends, and the simulator cuts one whose transfer outlasts it, as the service does.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from ddiloco.core.learner_side.learner_core import Learner
from ddiloco.core.shared import deadlines
from ddiloco.core.shared.actions import Admitted, Send, SendJoin
from ddiloco.core.shared.deadlines import (
    CLIENT_ANSWER_S,
    CLIENT_UPLOAD_BYTES_PER_S,
    CLIENT_UPLOAD_LINK,
    LinkExpectation,
    admission_window_s,
    call_deadline_s,
    client_join_link,
    join_state_bytes,
    stream_deadline_s,
)
from ddiloco.core.shared.messages import Contribution, FragmentUpdate, Join
from ddiloco.core.sync_side.registry import Registry
from ddiloco.settings.config_sources import build_config
from ddiloco.sim.events import CallTimeout, PushArrives, StateArrives
from ddiloco.sim.harness import Recorder
from ddiloco.sim.synthetic import TOKENS_SHAPE, SyntheticWorkload, WalkModel
from ddiloco.sim.virtual_cluster import VirtualCluster

CONFIG = build_config(preset="tiny", overrides=(
    "run.learners=1", "protocol.quorum=1", "protocol.fragments=2", "protocol.period=4", "protocol.grace_gamma=0.0",
    f"protocol.min_link_bytes_per_s={CLIENT_UPLOAD_BYTES_PER_S}",
    f"cluster.rpc_timeout_s={CLIENT_ANSWER_S}", f"cluster.bandwidth_bps={8 * CLIENT_UPLOAD_BYTES_PER_S}"))
NAME = "learner-0"
TOKENS_PER_STEP = TOKENS_SHAPE[0] * TOKENS_SHAPE[1]


def cluster() -> VirtualCluster:
    workload = SyntheticWorkload(CONFIG)
    sim = VirtualCluster(workload, Recorder(CONFIG, workload))  # type: ignore[arg-type]
    sim.checker = None  # the test carries messages by hand, past the checker's bookkeeping
    return sim


def call_timeouts(sim: VirtualCluster) -> dict[int, float]:
    """call id -> when the simulator gives that call up."""
    return {e.what.call_id: e.time for e in sim.queue.pending() if isinstance(e.what, CallTimeout)}


def first_sends(core: Learner, tokens: int) -> tuple[list[Send], float]:
    """A step a second from time 0 until the learner sends: what it sends, and when."""
    for step in range(1, 3 * CONFIG.protocol.period):
        sends = core.record_step(tokens, 1.0, float(step))
        if sends:
            return sends, float(step)
    raise AssertionError("the learner sent nothing in three periods")


def sim_join_and_send(sim: VirtualCluster) -> tuple[float, Contribution, float]:
    """The simulator's learner driver joins and sends its first contribution: (the join's deadline,
    the contribution, its deadline)."""
    node, sync = sim.learners[0], sim.syncs[0]
    node.execute(sim, node.core.start(0.0))
    [(join_id, (join, _))] = node.calls.items()
    admitted = next(a for a in sync.core.handle(join, 0.0) if isinstance(a, Admitted))
    node.core.on_admitted(sync.core.state_for(admitted.state), 0.0)
    node.execute(sim, first_sends(node.core, sim.tokens_per_step)[0][:1])
    [(send_id, (contribution, _))] = [(i, c) for i, c in node.calls.items() if i != join_id]
    times = call_timeouts(sim)
    return times[join_id], contribution, times[send_id]


class RecordingStub:
    """The real client's stub: records the deadline each call is given, answers nothing useful."""

    def __init__(self) -> None:
        self.timeouts: dict[str, float] = {}

    def Join(self, request: Any, timeout: float, metadata: Any) -> Any:
        self.timeouts["join"] = timeout
        return iter(())  # no header: the join is undelivered, which the core hears

    def Contribute(self, chunks: Any, timeout: float, metadata: Any) -> Any:
        from ddiloco.runtime.proto import ddiloco_pb2 as pb

        list(chunks)
        self.timeouts["contribute"] = timeout
        return pb.ContributeReply()


def real_join_and_send(contribution: Contribution, plan: Any) -> dict[str, float]:
    """The real learner driver's join and upload deadlines. The join's is set in the training
    process (``LearnerLink.dispatch`` hands it to the link's helper with the join), which calls
    ``SyncClient.join`` with it; the upload's is ``SyncClient.contribute``'s own, in the helper."""
    from ddiloco.runtime.call_errors import Unreachable
    from ddiloco.runtime.client import SyncClient
    from ddiloco.runtime.learner.helper_wire import Msg
    from ddiloco.runtime.learner.link import LearnerLink
    from ddiloco.runtime.learner.staging import HostStaging

    protocol = CONFIG.protocol.for_mode(CONFIG.run.mode, CONFIG.run.learners)
    core = Learner(NAME, protocol, plan, dict(WalkModel().named_parameters()), boot="real",
                   tokens_per_step=TOKENS_PER_STEP)
    link = LearnerLink(core, [], threading.RLock(), HostStaging(torch.device("cpu"), None, [], []))
    to_helper: list[tuple[Msg, Any, tuple]] = []
    link._request = lambda kind, request, shard, *extra, rid=None: to_helper.append((kind, request, extra))
    link.dispatch(core.start(0.0))
    [(join, timeout_s)] = [(request, extra[0]) for kind, request, extra in to_helper if kind is Msg.JOIN]
    client = SyncClient("127.0.0.1:9")  # never connected: the stub answers
    stub = client.stub = RecordingStub()
    try:
        with pytest.raises(Unreachable):  # what the helper's ShardWorker does with it; the stub answers no state
            client.join(join, timeout_s)
        client.contribute(contribution)
    finally:
        client.close()
    return stub.timeouts


def test_a_contribution_and_a_join_get_the_same_deadline_from_both_learner_drivers():
    sim = cluster()
    assert sim.link == CLIENT_UPLOAD_LINK == client_join_link(sim.protocol)  # the same link in both worlds
    join_s, contribution, contribute_s = sim_join_and_send(sim)
    real = real_join_and_send(contribution, sim.plan)
    state = join_state_bytes(sim.plan, sim.protocol, 0)
    assert state == sim.syncs[0].core.state_bytes > 0
    assert join_s == real["join"] == call_deadline_s(state, CLIENT_UPLOAD_LINK) > CLIENT_ANSWER_S  # the state counts
    assert contribute_s == real["contribute"] == call_deadline_s(len(contribution.payload), CLIENT_UPLOAD_LINK)


@pytest.fixture
def windows(monkeypatch) -> dict[str, list[float]]:
    """The admission windows every synchronizer core opened, and the transfer deadlines the real
    service gave the states it sent."""
    from ddiloco.runtime.sync.call_limits import CallLimits

    seen: dict[str, list[float]] = {"core": [], "service": []}
    register, transfer = Registry.register, CallLimits.transfer_deadline_s

    def registered(self, join, now, **limits):
        rec = register(self, join, now, **limits)
        seen["core"].append(rec.lease_until_s - now)  # how long the session lives without its state
        return rec

    def transferred(self, state_bytes):
        seen["service"].append(transfer(self, state_bytes))
        return seen["service"][-1]

    monkeypatch.setattr(Registry, "register", registered)
    monkeypatch.setattr(CallLimits, "transfer_deadline_s", transferred)
    return seen


def in_process_sync(clock: list[float]) -> Any:
    """A gRPC synchronizer in this process, on the clock ``clock[0]``."""
    from ddiloco.runtime.layout import model_layout
    from ddiloco.runtime.sync.service import ServiceOptions
    from ddiloco.testing import InProcessSync

    model = WalkModel()
    protocol = CONFIG.protocol.for_mode(CONFIG.run.mode, CONFIG.run.learners)
    return InProcessSync(CONFIG, ServiceOptions(clock=lambda: clock[0]),
                         layout=model_layout(protocol, model.named_parameters(), model.embedding_param_names()))


def test_a_join_s_state_is_held_to_the_core_s_admission_window_in_both_drivers(windows):
    from ddiloco.runtime.client import SyncClient

    sim = cluster()
    node, sync = sim.learners[0], sim.syncs[0]
    window = admission_window_s(sync.core.state_bytes, sim.protocol)
    sim.network.partition(NAME, until_s=1e9)  # the state never arrives: when does the synchronizer give it up?
    node.execute(sim, node.core.start(0.0))
    [(call_id, (join, _))] = node.calls.items()
    sync.on_request(sim, 0, node.boot, call_id, join)
    [given_up] = [e.time for e in sim.queue.pending() if isinstance(e.what, StateArrives)]
    assert given_up == call_timeouts(sim)[call_id]  # when its caller does: the learner node's join deadline
    assert windows["core"] == [window]
    windows["core"].clear()

    real = in_process_sync([0.0])
    client = SyncClient(f"127.0.0.1:{real.port}")
    try:
        client.join(Join(NAME, "real"))
    finally:
        client.close()
        real.close()
    assert windows["core"] == windows["service"] == [window]  # the service sends no longer than the session lives


@pytest.fixture
def stream_deadlines(monkeypatch) -> list[tuple[int, float]]:
    """(bytes, deadline) of every message either synchronizer held to the stream rule."""
    seen: list[tuple[int, float]] = []
    rule = deadlines.stream_deadline_s

    def recorded(nbytes, protocol):
        seen.append((nbytes, rule(nbytes, protocol)))
        return seen[-1][1]

    monkeypatch.setattr(deadlines, "stream_deadline_s", recorded)
    return seen


def merged_update_real(stream_deadlines: list) -> tuple[list[int], list[tuple[int, float]]]:
    """The real service merges one contribution; the learner subscribes again holding nothing of it:
    the versions it held, and the deadlines of what the service replayed."""
    from ddiloco.runtime.client import SyncClient

    clock = [0.0]
    real = in_process_sync(clock)
    client = SyncClient(f"127.0.0.1:{real.port}")
    protocol = CONFIG.protocol.for_mode(CONFIG.run.mode, CONFIG.run.learners)
    try:
        core = Learner(NAME, protocol, real.service.layout.plan, dict(WalkModel().named_parameters()), boot="real",
                       tokens_per_step=TOKENS_PER_STEP)
        [join] = [a.message for a in core.start(0.0) if isinstance(a, SendJoin)]
        result = client.join(join)
        core.on_admitted(result.state, 0.0)
        held = list(core.versions)
        # The service tells its core that the state arrived after the join returns: the session
        # starts then, so the clock moves on only once it has (else the steps come in 0 s).
        deadline = time.monotonic() + 30
        while real.call(lambda: real.service.host.query(lambda c: c.status().learners[0].joining)):
            assert time.monotonic() < deadline, "the service never heard that the state arrived"
            time.sleep(0.01)
        sends, clock[0] = first_sends(core, TOKENS_PER_STEP)
        send = sends[0]
        client.contribute(send.encode())
        stream_deadlines.clear()
        stream = client.updates(NAME, held, result.state.session)
        update = next(u for u in stream if isinstance(u, FragmentUpdate))
        stream.cancel()
        assert (update.fragment, update.version) == (send.fragment, held[send.fragment] + 1)
        return held, list(stream_deadlines)
    finally:
        client.close()
        real.close()


def merged_update_sim(sim: VirtualCluster, stream_deadlines: list) -> tuple[list[int], list[tuple[int, float]]]:
    node, sync = sim.learners[0], sim.syncs[0]
    node.execute(sim, node.core.start(0.0))
    [(call_id, (join, _))] = node.calls.items()
    admitted = next(a for a in sync.core.handle(join, 0.0) if isinstance(a, Admitted))
    node.core.on_admitted(sync.core.state_for(admitted.state), 0.0)
    held = list(node.core.versions)
    sends, sim.queue.now = first_sends(node.core, sim.tokens_per_step)
    send = sends[0]
    sync.on_request(sim, 0, node.boot, sim.new_call_id(), send.encode())
    assert sim.syncs[0].core.versions()[send.fragment] == held[send.fragment] + 1  # merged
    stream_deadlines.clear()
    sim.queue.clear()
    sync.replay_to(sim, NAME, held)  # the stream is back: what it missed is sent again
    return held, list(stream_deadlines)


def test_a_resubscription_s_replay_is_held_to_the_same_stream_deadline_in_both_drivers(stream_deadlines):
    sim = cluster()
    held_sim, sim_replay = merged_update_sim(sim, stream_deadlines)
    assert [e.what.message.version for e in sim.queue.pending() if isinstance(e.what, PushArrives)] == [1]
    held_real, real_replay = merged_update_real(stream_deadlines)
    assert held_sim == held_real
    assert len(sim_replay) == len(real_replay) == 1  # one update, one message (a chunk) in each
    (sim_bytes, sim_s), (real_bytes, real_s) = sim_replay[0], real_replay[0]
    for nbytes, seconds in (sim_replay[0], real_replay[0]):
        assert seconds == stream_deadline_s(nbytes, sim.protocol)
    # The same rule on what each sends: the update's payload with the simulator's fixed framing,
    # or its protobuf message; they differ by a few bytes of framing.
    assert abs(sim_bytes - real_bytes) < 256 and abs(sim_s - real_s) < 256 / sim.protocol.min_link_bytes_per_s

    # On a virtual link slower than the floor the replay cannot leave in time: the simulator cuts
    # it, as the service closes a stream whose message does not leave by its deadline.
    sim.link = LinkExpectation(CLIENT_ANSWER_S, bytes_per_s=sim_bytes / (2 * sim_s))
    sim.queue.clear()
    sync = sim.syncs[0]
    sync.replay_to(sim, NAME, held_sim)
    assert not [e for e in sim.queue.pending() if isinstance(e.what, PushArrives)]
