"""One scripted scenario, two drivers: the same sequence of core decisions.

Learners join, contribute, one crashes (its lease runs out), comes back as a new process
and rejoins, another misses an update (a gap) and joins again, the budget runs out and
everyone flushes and leaves. The script drives the learner cores itself; what differs is
the driver that carries the messages and runs the synchronizer: the virtual cluster's
(its network and its synchronizer node) or the real runtime's (a gRPC service on
loopback, its core host and update streams, the real client). Both must yield the same
decisions, learner side and synchronizer side: a driver that decided anything itself —
swallowed a refusal, skipped a stop notice, answered for the core — would show here.
"""

from __future__ import annotations

import itertools
import queue
import threading
from typing import Any, Iterator

import pytest
import torch

from ddiloco.core.learner_side.learner_core import Learner
from ddiloco.core.learner_side.learner_phase import LoopMove
from ddiloco.core.shared.actions import (
    Accepted,
    Admitted,
    Behind,
    Broadcast,
    Checkpoint,
    Fail,
    Finished,
    LeaseExpired,
    LogRound,
    Refused,
    RoundClosed,
    Send,
    SendHeartbeat,
    SendJoin,
    SendLeave,
    StateDelivered,
    StopLearners,
    SyncTimeObserved,
    Tick,
)
from ddiloco.core.shared.fragments import flatten, plan_fragments
from ddiloco.core.shared.messages import Contribution, FragmentUpdate, Heartbeat, Join, Leave, Session, StopNotice
from ddiloco.core.sync_side.registry import SESSION_TAG_BITS
from ddiloco.core.sync_side.run_state import RunLimits
from ddiloco.core.sync_side.synchronizer import Synchronizer
from ddiloco.measures.wire_bytes import ByteLedger, Direction
from ddiloco.settings.config_sources import build_config
from ddiloco.sim.events import (
    AtLearner,
    EventQueue,
    PushArrives,
    ReplyArrives,
    RequestArrives,
    StateArrives,
    SyncTick,
)
from ddiloco.sim.network import NetFaults, Network
from ddiloco.sim.sync_node import SyncNode
from ddiloco.sim.synthetic import WalkModel

NAMES = ("learner-0", "learner-1", "learner-2")
CONFIG = build_config(preset="tiny", overrides=(
    "run.learners=3", "protocol.fragments=2", "protocol.period=4", "protocol.quorum=3", "protocol.grace_gamma=0.0",
    "protocol.lease_s=10.0", "protocol.heartbeat_s=3.0", "run.tokens=3600"))
PROTOCOL = CONFIG.protocol
LIMITS = RunLimits(tokens=CONFIG.run.tokens, drain_timeout_s=20.0)
MODEL = WalkModel()
PLAN = plan_fragments([(n, tuple(p.shape)) for n, p in MODEL.named_parameters()], num_fragments=PROTOCOL.fragments,
                      period=PROTOCOL.period, embedding_names=MODEL.embedding_param_names())
INITIAL = [flatten([dict(MODEL.named_parameters())[n] for n in f.param_names]) for f in PLAN.fragments]
EMBEDS = [f.index for f in PLAN.fragments if f.is_embedding]


def registration(session: Session) -> int:
    """Which registration a session is (its number's unguessable low bits come from each driver's own salt)."""
    return session.number >> SESSION_TAG_BITS


def summary(action: Any) -> tuple:
    """A decision, without what legitimately differs between drivers (times, random incarnation ids,
    the random part of session numbers)."""
    if isinstance(action, Admitted):
        return ("admitted", action.learner_id, registration(action.state.session), action.state.versions(), action.stop)
    if isinstance(action, Accepted):
        return ("accepted", action.learner_id, type(action.request).__name__, action.stop)
    if isinstance(action, Refused):
        return ("refused", action.learner_id, type(action.request).__name__, str(action.reason))
    if isinstance(action, Broadcast):
        return ("broadcast", action.update.fragment, action.update.version, tuple(sorted(action.recipients)))
    if isinstance(action, LogRound):
        return ("log", action.update.fragment, action.update.version, action.plain)
    if isinstance(action, RoundClosed):
        return ("round", action.fragment, action.version, str(action.reason),
                tuple(sorted(m.learner_id for m in action.merged)))
    if isinstance(action, LeaseExpired):
        return ("expired", action.learner_id)
    if isinstance(action, StopLearners):
        return ("stop", tuple(sorted(action.recipients)))
    if isinstance(action, Finished):
        return ("finished",)
    if isinstance(action, Checkpoint):
        return ("checkpoint",)
    if isinstance(action, Send):
        h = action.header
        return ("send", h.fragment, h.base_version, h.seq, registration(h.session))
    if isinstance(action, SendJoin):
        return ("join",)
    if isinstance(action, SendHeartbeat):
        return ("heartbeat", registration(action.message.session))
    if isinstance(action, SendLeave):
        return ("leave",)
    if isinstance(action, Fail):
        return ("fail", str(action.reason))
    if isinstance(action, Behind):  # a fragment held for its update: its sends carry more steps
        return ("behind",)
    raise TypeError(action)


@pytest.fixture
def sync_decisions(monkeypatch) -> list[tuple]:
    """Every decision of every Synchronizer core in this test, in order (Ticks that did nothing, and the
    drivers' reports that a state arrived, which only move a lease, left out)."""
    log: list[tuple] = []
    original = Synchronizer.handle

    def recorded(self, event, now):
        actions = original(self, event, now)
        if actions or not isinstance(event, (Tick, SyncTimeObserved, StateDelivered)):
            log.append(("sync", type(event).__name__, tuple(summary(a) for a in actions)))
        return actions

    monkeypatch.setattr(Synchronizer, "handle", recorded)
    return log


# ---- the two drivers ---------------------------------------------------------------------


class SimDriver:
    """The virtual cluster's executors: its network and its synchronizer node, on its event queue."""

    def __init__(self) -> None:
        self.queue = EventQueue()
        # Instant links: the gRPC driver calls its synchronizer with the script's clock unchanged too.
        self.network = Network(list(NAMES), bandwidth_bps=float("inf"), latency_s=0.0, faults=NetFaults(), seed=0,
                               bytes_counter=ByteLedger())
        self.sync = SyncNode(lambda inc: Synchronizer(PROTOCOL, INITIAL, EMBEDS, limits=LIMITS, incarnation=inc),
                             seed=0, max_learners=LIMITS.max_learners)
        self.checker = None
        self._calls = itertools.count()
        self._replies: dict[int, Any] = {}
        self._pushes: list[tuple[str, Any]] = []
        self.sync.start(self)

    # what SyncNode needs of its host (ddiloco.sim.host.NodeHost)
    def push(self, event: AtLearner, fragment: int, size: int) -> float | None:
        arrivals = self.network.deliveries(NAMES[event.m], Direction.DOWN, fragment, size, self.queue.now)
        for t in arrivals:
            self.queue.at(t, event)
        return arrivals[0] if arrivals else None

    def push_to(self, name: str, fragment: int, size: int, message: Any) -> float | None:
        return self.push(PushArrives(NAMES.index(name), 0, message), fragment, size)

    def on_round(self, record: RoundClosed, value: torch.Tensor) -> None:
        pass

    def left_at(self, name: str) -> float:
        return self.network.left_at(name, Direction.DOWN)

    def process_up(self, m: int, boot: int) -> bool:
        return True  # the script's learners die only by its say, and it drops what was meant for them

    def call_deadline_s(self, nbytes: int) -> float:
        return 5.0

    # what the script needs
    def now(self) -> float:
        return self.queue.now

    def _run_until(self, t: float) -> None:
        while self.queue.next_time() <= t:
            event = self.queue.pop().what
            if isinstance(event, RequestArrives):
                self.sync.on_request(self, event.m, event.boot, event.call_id, event.request)
            elif isinstance(event, SyncTick):
                self.sync.on_tick(self, event.incarnation)
            elif isinstance(event, ReplyArrives):
                self._replies[event.call_id] = event.reply
            elif isinstance(event, PushArrives):
                self._pushes.append((NAMES[event.m], event.message))
            elif isinstance(event, StateArrives):
                self.sync.on_delivered(self, event.incarnation, event.m, event.boot, event.admitted, event.arrived)
        self.queue.now = max(self.queue.now, t)

    def request(self, name: str, message: Any) -> Any:
        call = next(self._calls)
        size = len(message.payload) if isinstance(message, Contribution) else 0
        for t in self.network.deliveries(name, Direction.UP, -1, size, self.queue.now):
            self.queue.at(t, RequestArrives(NAMES.index(name), 0, call, message, 0))
        self._run_until(self.queue.now)  # instant links: everything arrives now
        return self._replies.pop(call)

    def pushes(self) -> list[tuple[str, Any]]:
        out, self._pushes = self._pushes, []
        return out

    def advance(self, seconds: float) -> None:
        self._run_until(self.queue.now + seconds)
        self.sync.on_tick(self, self.sync.incarnation)

    def subscribe(self, name: str, core: Learner) -> None:
        """Nothing to do: the simulated stream is the link itself."""

    def disconnect(self, name: str) -> None:
        """Nothing to do: messages to a dead process are dropped by the script."""

    def close(self) -> None:
        """Nothing to release."""


class GrpcDriver:
    """The real runtime: a gRPC synchronizer service in this process, the real client, a clock we move."""

    def __init__(self, tmp_path) -> None:
        from ddiloco.runtime.client import SyncClient
        from ddiloco.runtime.layout import model_layout
        from ddiloco.runtime.sync.service import ServiceOptions
        from ddiloco.testing import InProcessSync

        self._now = 0.0
        layout = model_layout(PROTOCOL, MODEL.named_parameters(), MODEL.embedding_param_names())
        self.sync = InProcessSync(CONFIG, ServiceOptions(clock=self.now, drain_timeout_s=LIMITS.drain_timeout_s),
                                  layout=layout)
        self.client = SyncClient(f"127.0.0.1:{self.sync.port}")
        self._streams: dict[str, Any] = {}
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()

    def now(self) -> float:
        return self._now

    def request(self, name: str, message: Any) -> Any:
        from ddiloco.runtime.client import CallRefused

        try:
            if isinstance(message, Join):
                result = self.client.join(message)
                return Admitted(name, result.state, result.header.stop)
            if isinstance(message, Heartbeat):
                return Accepted(name, message, self.client.heartbeat(message).stop)
            if isinstance(message, Contribution):
                return Accepted(name, message, self.client.contribute(message).stop)
            assert isinstance(message, Leave)
            self.client.leave(message)
            return Accepted(name, message)
        except CallRefused as err:
            from ddiloco.core.shared.messages import RejectReason

            return Refused(name, message, RejectReason(err.reason), err.detail)

    def subscribe(self, name: str, core: Learner) -> None:
        old = self._streams.pop(name, None)
        if old is not None:
            old.cancel()
        stream = self.client.updates(name, list(core.versions), core.session)
        self._streams[name] = stream

        def read() -> None:
            for update in stream:
                self._inbox.put((name, update))

        threading.Thread(target=read, daemon=True).start()

    def disconnect(self, name: str) -> None:
        stream = self._streams.pop(name, None)
        if stream is not None:
            stream.cancel()

    def pushes(self, expected: int) -> list[tuple[str, Any]]:
        out = []
        for _ in range(expected):
            out.append(self._inbox.get(timeout=30))
        return out

    def advance(self, seconds: float) -> None:
        self._now += seconds
        self.sync.call(lambda: self.sync.service.host.handle(Tick()))

    def close(self) -> None:
        for stream in self._streams.values():
            stream.cancel()
        self.client.close()
        self.sync.close()


# ---- the script ----------------------------------------------------------------------------


class Script:
    """Drives the learner cores through the scenario over one driver and records every decision."""

    def __init__(self, driver: Any, sync_log: list[tuple]) -> None:
        self.driver = driver
        self.sync_log = sync_log
        self.log: list[tuple] = []
        self.cores: dict[str, Learner] = {}
        self.params: dict[str, dict[str, torch.Tensor]] = {}
        self.down: set[str] = set()
        self.drop_next: set[str] = set()
        self._seen = 0
        self._walks = {name: torch.Generator().manual_seed(i) for i, name in enumerate(NAMES)}

    def decisions(self) -> list[tuple]:
        return self.log

    def _note_sync(self) -> None:
        self.log += self.sync_log
        self.sync_log.clear()

    def start(self, name: str, boot: str) -> None:
        model = WalkModel()
        self.params[name] = dict(model.named_parameters())
        self.cores[name] = Learner(name, PROTOCOL, PLAN, self.params[name], boot=boot)
        self.down.discard(name)
        self.carry(name, self.cores[name].start(self.driver.now()))

    def carry(self, name: str, actions: list[Any]) -> None:
        """Carry out a learner's actions, synchronously, and hand it what comes back."""
        core = self.cores[name]
        for action in actions:
            self.log.append((name, *summary(action)))
            if isinstance(action, Send):
                message: Any = action.encode()
            elif isinstance(action, (SendJoin, SendHeartbeat, SendLeave)):
                message = action.message
            else:
                continue
            reply = self.driver.request(name, message)
            self._note_sync()
            now = self.driver.now()
            if isinstance(reply, Admitted):
                follow = core.on_admitted(reply.state, now, stop=reply.stop)
                self.driver.subscribe(name, core)
            elif isinstance(reply, Accepted):
                follow = core.on_accepted(message, now, stop=reply.stop)
            else:
                follow = core.on_refused(message, reply.reason, now)
            self.carry(name, follow)
            self.deliver()

    def expected_pushes(self) -> int:
        """Stream messages the synchronizer's decisions since the last call send to listening learners."""
        n = 0
        for entry in self.log[self._seen:]:
            if entry[0] == "sync":
                for decision in entry[2]:
                    if decision[0] == "broadcast":
                        n += sum(1 for r in decision[3] if r not in self.down)
                    elif decision[0] == "stop":
                        n += sum(1 for r in decision[1] if r not in self.down)
        self._seen = len(self.log)
        return n

    def deliver(self) -> None:
        expected = self.expected_pushes()
        pushes = self.driver.pushes(expected) if isinstance(self.driver, GrpcDriver) else self.driver.pushes()
        for name, message in sorted(pushes, key=lambda p: (p[0], getattr(p[1], "fragment", -1),
                                                           getattr(p[1], "version", 0))):
            if name in self.down:
                continue
            core, now = self.cores[name], self.driver.now()
            if isinstance(message, StopNotice):
                self.log.append((name, "stopped"))
                self.carry(name, core.on_stop(now))
            elif name in self.drop_next and isinstance(message, FragmentUpdate):
                self.drop_next.discard(name)
                self.log.append((name, "lost update", message.fragment, message.version))
            else:
                self.carry(name, core.on_update(message, now))

    def steps(self, name: str, count: int) -> None:
        for _ in range(count):
            core = self.cores[name]
            move = core.between_steps(self.driver.now())
            if move is LoopMove.CLOSE:
                self.carry(name, core.close(self.driver.now()))
            if move is not LoopMove.STEP:
                return
            with torch.no_grad():
                for p in self.params[name].values():
                    p.add_(torch.randn(p.shape, generator=self._walks[name]), alpha=0.01)
            self.carry(name, list(core.record_step(16, 1.0, self.driver.now())))

    def wait(self, seconds: float) -> None:
        """Let time pass in whole seconds: the synchronizer and every live learner get their ticks."""
        for _ in range(int(seconds)):
            self.driver.advance(1.0)
            self._note_sync()
            self.deliver()
            for name in NAMES:
                if name not in self.down and name in self.cores:
                    self.carry(name, self.cores[name].tick(self.driver.now()))


def scenario(script: Script) -> Iterator[str]:
    for i, name in enumerate(NAMES):
        script.start(name, boot=f"{name}#0")
        yield f"{name} joined"
    for _ in range(2):  # everyone contributes; every round closes with all three
        for name in NAMES:
            script.steps(name, PROTOCOL.period)
        script.wait(1)
    script.down.add("learner-2")  # learner-2's process dies: silence
    script.driver.disconnect("learner-2")
    yield "crash"
    for _ in range(4):  # the others go on; learner-2's lease runs out; rounds close without it
        for name in NAMES[:2]:
            script.steps(name, 2)
        script.wait(3)
    script.start("learner-2", boot="learner-2#1")  # a new process: it joins and adopts the state
    yield "rejoin"
    # learner-1 misses one update. Its next send of that fragment waits for it (a Δ from the same
    # anchor would carry its merged work again), and every round needs it (K=3): when the wait
    # ends (a lease), that send is refused as
    # ``repeated``; it waits once more, is refused so again, and joins again.
    script.drop_next.add("learner-1")
    for _ in range(4):
        for name in NAMES:
            script.steps(name, PROTOCOL.period)
        script.wait(1)
    yield "gap"
    for _ in range(40):  # until the budget runs out: stop, flush, leave, finish
        for name in NAMES:
            script.steps(name, PROTOCOL.period)
        script.wait(1)
    yield "end"


def test_the_simulator_and_the_grpc_runtime_make_the_same_decisions(sync_decisions, tmp_path):
    runs = {}
    for label, make in (("sim", SimDriver), ("grpc", lambda: GrpcDriver(tmp_path))):
        driver = make()
        script = Script(driver, sync_decisions)
        try:
            for _ in scenario(script):
                pass
        finally:
            driver.close()
        runs[label] = script.decisions()
        sync_decisions.clear()
    sim, grpc_run = runs["sim"], runs["grpc"]
    flat = [d for entry in sim for d in (entry[2] if entry[0] == "sync" else [entry])]
    # The scenario did what it says: expiry, rejoin, a gap answered by a join, the stop, the end.
    assert ("expired", "learner-2") in flat
    assert ("learner-2", "join") in sim and sum(1 for e in sim if e[:2] == ("learner-2", "join")) == 2
    assert any(e[:2] == ("learner-1", "lost update") for e in sim)
    assert sum(1 for e in sim if e[:2] == ("learner-1", "join")) == 2  # the lost update made it join again
    assert any(d[:2] == ("refused", "learner-1") and "repeated" in d for d in flat), flat
    assert any(d[0] == "stop" for d in flat) and ("finished",) in flat
    assert [e for e in sim if e[1:] == ("leave",)] == [(n, "leave") for n in sorted(NAMES)] or \
        sorted(e[0] for e in sim if e[1:] == ("leave",)) == sorted(NAMES)
    assert len(sim) > 100
    for i, (a, b) in enumerate(zip(sim, grpc_run)):
        assert a == b, f"decision {i}: the simulator did {a}, the runtime {b}"
    assert len(grpc_run) == len(sim), (sim[-5:], grpc_run[-5:])
