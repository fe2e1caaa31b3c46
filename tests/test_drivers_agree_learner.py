"""Both drivers, learner side: the same decisions through ``LearnerNode`` and ``LearnerLink``.

``test_drivers_agree.py`` scripts the learner cores itself, so a driver that decided for its
learner (joined through its own loop, dropped a send, swallowed a refusal) would not show
there. Here nothing is scripted: two learners train synchronous DiLoCo (every learner waits
for each merge, so what it sends and applies is fixed by the protocol, not by timing), once on
the virtual cluster (``LearnerNode`` over the virtual network) and once as two
``LearnerRuntime`` in threads against a gRPC synchronizer in this process (``LearnerLink``'s
threads, the real client, the update stream). Every learner core's decisions are recorded as
they are made; the two drivers must make them in the same order, with the same contents.

The run's end is the one place where timing may differ: a real learner never waits for the
network, so it may take a step or two before the synchronizer's stop reaches it. The decisions
are compared up to the first stop a learner heard of, and both drivers must then close every
learner with one leave. (``align_sends`` is off: it phases sends by the round's age in step
times, and a walk step takes microseconds on a real clock against a second on the virtual one.)
"""

from __future__ import annotations

import threading
from collections import defaultdict

import pytest

from ddiloco.core.learner_side.learner_core import Learner
from ddiloco.core.shared.actions import Send, SendLeave
from ddiloco.core.shared.messages import RejectReason
from ddiloco.settings.config_sources import build_config
from ddiloco.sim.harness import Recorder
from ddiloco.sim.synthetic import TOKENS_SHAPE, SyntheticWorkload, WalkModel
from ddiloco.sim.virtual_cluster import VirtualCluster

TOKENS_PER_STEP = TOKENS_SHAPE[0] * TOKENS_SHAPE[1]
ROUNDS = 6
CONFIG = build_config(preset="tiny", overrides=(
    "run.mode=diloco", "run.learners=2", "protocol.fragments=2", "protocol.period=4", "protocol.overlap=0",
    # No lease runs out and no heartbeat claims progress (which would move the budget by the clock):
    "protocol.lease_s=3000", "protocol.heartbeat_s=1000",
    # A walk step takes microseconds: no claim may be clipped as faster than plausible, and no
    # send re-phased by a round age that is hundreds of such steps (align_sends reads the clock).
    "protocol.min_step_s=1e-9", "protocol.align_sends=false",
    f"run.tokens={2 * ROUNDS * 4 * TOKENS_PER_STEP}"))

STOP = ("stop",)


@pytest.fixture
def decisions(monkeypatch) -> dict[str, list[tuple]]:
    """Per learner: its joins, what it sends (fragment, base version, seq), the updates it applies
    (fragment, the version it holds after), its leave, and a STOP marker where it first heard that
    the run is over."""
    log: dict[str, list[tuple]] = defaultdict(list)
    lock = threading.Lock()

    def note(core: Learner, *entries: tuple) -> None:
        with lock:
            log[core.learner_id].extend(entries)

    def sends(actions: list) -> list[tuple]:
        out: list[tuple] = []
        for a in actions:
            if isinstance(a, Send):
                out.append(("send", a.header.fragment, a.header.base_version, a.header.seq))
            elif isinstance(a, SendLeave):
                out.append(("leave",))
        return out

    def wrap(name: str, entries) -> None:
        original = getattr(Learner, name)

        def recorded(self, *args, **kwargs):
            before_stop = self.should_stop
            actions = original(self, *args, **kwargs)
            note(self, *entries(self, args, kwargs, actions, before_stop))
            return actions

        monkeypatch.setattr(Learner, name, recorded)

    def stopped(self, before_stop: bool) -> list[tuple]:
        return [STOP] if self.should_stop and not before_stop else []

    wrap("start", lambda self, a, kw, actions, b: [("join",)])
    wrap("on_admitted", lambda self, a, kw, actions, b: [("admitted", tuple(self.versions))] + stopped(self, b))
    wrap("record_step", lambda self, a, kw, actions, b: sends(actions))
    wrap("on_update", lambda self, a, kw, actions, b: [("update", a[0].fragment, self.versions[a[0].fragment])])
    wrap("on_accepted", lambda self, a, kw, actions, b: stopped(self, b))
    wrap("on_refused", lambda self, a, kw, actions, b: stopped(self, b) if a[1] is RejectReason.FINISHED else [])
    wrap("on_stop", lambda self, a, kw, actions, b: stopped(self, b))
    wrap("close", lambda self, a, kw, actions, b: sends(actions))
    return log


def until_stop(entries: list[tuple]) -> list[tuple]:
    return entries[:entries.index(STOP)] if STOP in entries else entries


def run_virtual() -> None:
    workload = SyntheticWorkload(CONFIG)
    VirtualCluster(workload, Recorder(CONFIG, workload)).run()  # type: ignore[arg-type]


def run_runtime() -> None:
    from ddiloco.runtime.layout import model_layout
    from ddiloco.runtime.learner import LearnerRuntime
    from ddiloco.runtime.sync.service import ServiceOptions
    from ddiloco.testing import InProcessSync

    model = WalkModel()
    protocol = CONFIG.protocol.for_mode(CONFIG.run.mode, CONFIG.run.learners)
    sync = InProcessSync(CONFIG, ServiceOptions(),
                         layout=model_layout(protocol, model.named_parameters(), model.embedding_param_names()))
    errors: list[BaseException] = []

    def learner(index: int) -> None:
        try:
            runtime = LearnerRuntime(WalkModel(), f"127.0.0.1:{sync.port}", f"learner-{index}",
                                     tokens_per_step=TOKENS_PER_STEP, join_timeout_s=60)
            steps = 0
            while not runtime.should_stop:
                runtime.step(TOKENS_PER_STEP)
                steps += 1
                assert steps < 100 * ROUNDS * CONFIG.protocol.period, "the run never stopped"
            runtime.close()
        except BaseException as err:  # reported on the test's thread
            errors.append(err)

    threads = [threading.Thread(target=learner, args=(i,)) for i in range(CONFIG.run.learners)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a learner did not finish in 120 s"
    finally:
        sync.close()
    if errors:
        raise errors[0]


def test_learner_nodes_and_learner_links_make_the_same_decisions(decisions) -> None:
    run_virtual()
    virtual = {name: list(entries) for name, entries in decisions.items()}
    decisions.clear()
    run_runtime()
    real = dict(decisions)
    assert sorted(virtual) == sorted(real) == ["learner-0", "learner-1"]
    for name in virtual:
        v, r = until_stop(virtual[name]), until_stop(real[name])
        common = min(len(v), len(r))
        assert v[:common] == r[:common], name
        # Both trained most of the budget before the stop: the comparison covers the run, not its start.
        merged = [e for e in v[:common] if e[0] == "update"]
        assert len(merged) >= ROUNDS, (name, v)
        assert v[:2] == [("join",), ("admitted", (0, 0))]
        for entries in (virtual[name], real[name]):  # one join, one leave, nothing sent after it
            assert entries.count(("join",)) == entries.count(("leave",)) == 1, (name, entries)
            assert not any(e[0] == "send" for e in entries[entries.index(("leave",)):]), (name, entries)
