"""The synchronizer service in-process: boundary validation, learner runtime API, resume."""

from __future__ import annotations

import asyncio
import math
import struct
from dataclasses import replace

import grpc
import pytest
import torch

from ddiloco import cli
from ddiloco.core.shared.codecs import get_codec
from ddiloco.core.shared.errors import ConfigError
from ddiloco.core.shared.messages import Contribution, Join, Session
from ddiloco.core.sync_side.replay import REPLAY_UPDATES
from ddiloco.runtime import wire
from ddiloco.runtime.auth import client_metadata
from ddiloco.runtime.client import AuthenticationError, CallRefused, SyncClient
from ddiloco.runtime.learner.runtime import LayoutMismatch, LearnerRuntime
from ddiloco.runtime.proto import ddiloco_pb2 as pb
from ddiloco.runtime.sync.resume import Resume
from ddiloco.runtime.sync.service import ServiceOptions, SyncService
from ddiloco.settings.config_sources import build_config
from ddiloco.testing import sync_argv, wait_for
from ddiloco.workload.model import ByteTransformer
from ddiloco.workload.workload import Workload

TOKEN = "s3cret-token"


def tiny(**overrides: object) -> object:
    sets = ("run.learners=2",) + tuple(f"{k}={v}" for k, v in overrides.items())
    return build_config(preset="tiny", overrides=sets)


def make_contribution(sync: SyncService, learner: str, session: Session, fragment: int, seq: int, *,
                      payload: bytes | None = None, base_version: int = 0, codec: str = "int4") -> Contribution:
    numel = sync.layout.plan.fragments[min(fragment, len(sync.layout.plan.fragments) - 1)].numel
    if payload is None:
        payload = get_codec(codec).encode(torch.full((numel,), 1e-3))
    return Contribution(learner_id=learner, session=session, fragment=fragment, base_version=base_version, seq=seq,
                        tokens=256, steps=1, compute_s=0.01, step_time_s=0.01, codec=codec, payload=payload)


def refused(call) -> CallRefused:
    with pytest.raises(CallRefused) as info:
        call()
    return info.value


def test_bad_messages_are_rejected_with_their_reason_counted_and_never_touch_global_state(inproc_sync):
    s = inproc_sync(tiny(), ServiceOptions(token=TOKEN))
    sync = s.service
    client = SyncClient(f"127.0.0.1:{s.port}", token=TOKEN)
    session = client.join(Join("intruder", "boot")).state.session
    before = client.fetch_state()
    numel0 = sync.layout.plan.fragments[0].numel
    int4 = get_codec("int4")
    good = int4.encode(torch.zeros(numel0))
    nan_payload = struct.pack("<f", math.nan) + good[4:]
    huge_payload = int4.encode(torch.full((numel0,), 1e30))

    cases = {
        "bad_size": lambda: client.contribute(make_contribution(sync, "intruder", session, 0, 0, payload=good[:-1])),
        "non_finite": lambda: client.contribute(make_contribution(sync, "intruder", session, 0, 0, payload=nan_payload)),
        "norm_bound": lambda: client.contribute(make_contribution(sync, "intruder", session, 0, 0, payload=huge_payload)),
        "unknown_fragment": lambda: client.contribute(make_contribution(sync, "intruder", session, 99, 0)),
        "bad_codec": lambda: client.contribute(make_contribution(sync, "intruder", session, 0, 0, codec="int8",
                                                                payload=good)),
        "future_version": lambda: client.contribute(make_contribution(sync, "intruder", session, 0, 0, base_version=7)),
        "unknown_learner": lambda: client.contribute(make_contribution(sync, "ghost", session, 0, 0)),
        "too_large": lambda: client.contribute_chunks([pb.ContributionChunk(
            header=pb.ContributionHeader(learner_id="intruder", payload_bytes=10**9, codec="int4", steps=1))]),
        "chunk_assembly": lambda: client.contribute_chunks([
            pb.ContributionChunk(header=pb.ContributionHeader(learner_id="intruder", payload_bytes=8, codec="int4",
                                                              steps=1, session=wire.session_to_pb(session)),
                                 data=b"1234"),
            pb.ContributionChunk(offset=6, data=b"5678"),
        ]),
    }
    codes = {}
    for reason, call in cases.items():
        err = refused(call)
        assert err.reason == reason, (reason, err.detail)
        assert err.detail.startswith(reason)
        codes[reason] = err.code
    assert codes["bad_size"] == grpc.StatusCode.INVALID_ARGUMENT
    assert codes["unknown_learner"] == grpc.StatusCode.FAILED_PRECONDITION
    assert codes["too_large"] == grpc.StatusCode.RESOURCE_EXHAUSTED

    # Garbage where a protobuf message should be, on a raw channel.
    channel = grpc.insecure_channel(f"127.0.0.1:{s.port}")
    raw = channel.unary_unary("/ddiloco.v2.Synchronizer/Heartbeat")
    with pytest.raises(grpc.RpcError) as info:
        raw(b"\xff\xff\xff\xff\x0f", metadata=client_metadata(TOKEN), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("malformed")
    # Another protocol version, and a wrong token.
    with pytest.raises(grpc.RpcError) as info:
        raw(pb.HeartbeatRequest(learner_id="intruder").SerializeToString(),
            metadata=(("ddiloco-protocol", "99"), ("authorization", f"Bearer {TOKEN}")), timeout=10)
    assert info.value.details().startswith("bad_protocol_version")
    channel.close()
    with SyncClient(f"127.0.0.1:{s.port}", token="wrong") as intruder, pytest.raises(AuthenticationError):
        intruder.status()

    after = client.fetch_state()
    assert after.versions() == before.versions() == (0, 0, 0)
    for a, b in zip(before.fragments, after.fragments):
        assert torch.equal(a.values, b.values)

    # A valid contribution goes through; the same one again is a duplicate.
    ok = make_contribution(sync, "intruder", session, 0, 0)
    client.contribute(ok)
    assert refused(lambda: client.contribute(ok)).reason == "duplicate"

    status = client.status_dict()
    expected = set(cases) | {"malformed", "bad_protocol_version", "unauthenticated", "duplicate"}
    assert set(status["rejections"]) == expected
    assert all(count == 1 for count in status["rejections"].values()), status["rejections"]
    intruder = next(lr for lr in status["learners"] if lr["id"] == "intruder")
    # Everything but the ghost's, the raw-channel garbage and the wrong token names the intruder.
    assert intruder["rejected"] == len(cases) - 1 + 1
    assert intruder["accepted"] == 1
    assert status["fragments"][0]["version"] == 1
    client.close()


def _train(runtime: LearnerRuntime, workload: Workload, model: ByteTransformer, index: int, steps: int) -> None:
    trainer = workload.new_trainer(model)
    sampler = workload.sampler(index)
    for _ in range(steps):
        x, y = sampler.next_batch()
        trainer.step(x, y)
        runtime.step(tokens=x.numel())


def test_a_status_asked_as_the_service_stops_is_its_last_one_not_an_error() -> None:
    """The status page asks every 250 ms. After a SIGTERM its question ran on the core's thread
    pool once the pool had shut down: ``RuntimeError: cannot schedule new futures after shutdown``,
    a traceback in the synchronizer's log at exit."""

    async def main() -> None:
        service = SyncService(tiny(), ServiceOptions())
        service.start_host()
        before = await service.status_reply()
        asked = asyncio.ensure_future(service.status_reply())  # runs while the stop is under way
        await service.stop()
        during, after = await asked, await service.status_reply()
        assert during.incarnation == after.incarnation == before.incarnation
        assert [f.version for f in after.fragments] == [f.version for f in before.fragments]

    asyncio.run(main())


def test_learner_runtime_in_a_user_loop_advances_the_global_model(inproc_sync):
    config = tiny()
    s = inproc_sync(config)
    workload = Workload.build(config)
    model = workload.new_model()
    runtime = LearnerRuntime(model, f"127.0.0.1:{s.port}", "learner-0")
    _train(runtime, workload, model, 0, 3 * config.protocol.period)
    runtime.close()
    status = SyncClient(f"127.0.0.1:{s.port}").status_dict()
    lr = status["learners"][0]
    assert lr["id"] == "learner-0" and lr["accepted"] >= 3 and not lr["alive"]  # left
    assert all(f["version"] >= 1 for f in status["fragments"])
    assert runtime.stats.contributions_sent == lr["accepted"]
    assert status["tokens"] == 3 * config.protocol.period * workload.tokens_per_step


def test_prometheus_gauges_follow_the_run(inproc_sync):

    """Learners alive, fragment versions and merge coherence as a scrape would read them."""
    config = tiny(**{"protocol.quorum": 2})  # every round merges both learners: its coherence is measured
    s = inproc_sync(config)
    workload = Workload.build(config)
    models = [workload.new_model() for _ in range(2)]
    runtimes = [LearnerRuntime(model, f"127.0.0.1:{s.port}", f"learner-{i}") for i, model in enumerate(models)]
    registry = s.service.metrics.registry
    trainers = [workload.new_trainer(model) for model in models]
    samplers = [workload.sampler(index) for index in range(2)]
    for _ in range(3 * config.protocol.period):  # the two learners step in turn
        for runtime, trainer, sampler in zip(runtimes, trainers, samplers):
            x, y = sampler.next_batch()
            trainer.step(x, y)
            runtime.step(tokens=x.numel())
    assert registry.get_sample_value("ddiloco_learners_alive") == 2
    fragments = range(len(s.service.core.versions()))
    assert all((registry.get_sample_value("ddiloco_fragment_version", {"fragment": str(p)}) or 0) >= 1
               for p in fragments)
    coherence = [registry.get_sample_value("ddiloco_merge_coherence", {"fragment": str(p)}) for p in fragments]
    assert any(c is not None for c in coherence) and all(0 < c <= 1.0001 for c in coherence if c is not None)
    for runtime in runtimes:
        runtime.close()
    # A leave is acknowledged before the service's observer has seen it: wait for the gauge.
    wait_for(lambda: registry.get_sample_value("ddiloco_learners_alive") == 0, "the gauge to count no learner")
    status = SyncClient(f"127.0.0.1:{s.port}").status_dict()  # issue 44: the two counts disagreed by the framing
    for direction in ("up", "down"):
        assert registry.get_sample_value("ddiloco_wire_bytes_total", {"direction": direction}) == status[f"bytes_{direction}"]


def test_a_model_that_does_not_match_the_served_layout_is_refused(inproc_sync):
    s = inproc_sync(tiny())
    other = ByteTransformer(replace(tiny().model, d_model=64))
    with pytest.raises(LayoutMismatch):
        LearnerRuntime(other, f"127.0.0.1:{s.port}", "learner-0")


def test_resume_restores_versions_and_values_and_refuses_to_clobber(inproc_sync, tmp_path):
    config = tiny()
    state_dir = tmp_path / "state"
    s = inproc_sync(config, ServiceOptions(state_dir=state_dir))
    workload = Workload.build(config)
    model = workload.new_model()
    runtime = LearnerRuntime(model, f"127.0.0.1:{s.port}", "learner-0")
    _train(runtime, workload, model, 0, 2 * config.protocol.period)
    runtime.close()
    with pytest.raises(ConfigError, match="in use"):
        SyncService(config, ServiceOptions(state_dir=state_dir, resume=Resume.REQUIRED))
    s.call(s.service.checkpoint)
    with SyncClient(f"127.0.0.1:{s.port}") as client:
        saved = client.fetch_state()
        accepted = client.status_dict()["learners"][0]["accepted"]
    s.close()

    with pytest.raises(ConfigError, match="--resume"):
        SyncService(config, ServiceOptions(state_dir=state_dir))
    r = inproc_sync(config, ServiceOptions(state_dir=state_dir, resume=Resume.REQUIRED))
    with SyncClient(f"127.0.0.1:{r.port}") as client:
        restored = client.fetch_state()
        status = client.status_dict()
    assert restored.versions() == saved.versions() and min(saved.versions()) >= 1
    for a, b in zip(saved.fragments, restored.fragments):
        assert torch.equal(a.values, b.values)
    assert status["learners"][0]["accepted"] == accepted and not status["learners"][0]["alive"]
    assert status["instance_id"] != ""

    # --resume-if-present (the deploy scripts' one command line) resumes the same state.
    r.close()
    r = inproc_sync(config, ServiceOptions(state_dir=state_dir, resume=Resume.IF_PRESENT))
    with SyncClient(f"127.0.0.1:{r.port}") as client:
        assert client.fetch_state().versions() == saved.versions()


@pytest.mark.parametrize("existing", [False, True])
def test_resume_with_no_state_is_one_line_and_exit_2_with_nothing_created(tmp_path, capsys, existing):
    """Issue 26: ``--resume`` on a directory with no run's state (a typo, a volume not mounted) started
    a new run beside the real one. Now an error; --resume-if-present keeps the deploy scripts' behaviour."""
    state = tmp_path / "state"
    if existing:
        state.mkdir()
    code = cli.main(sync_argv("--resume", state_dir=state))
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"ddiloco: error: --resume: --state-dir {str(state)!r} holds no run's state")
    assert "--resume-if-present" in err
    assert state.exists() == existing and (not existing or not any(state.iterdir()))
    code = cli.main(sync_argv("--resume"))
    err = capsys.readouterr().err
    assert code == 2 and err == "ddiloco: error: --resume needs --state-dir: without one there is no run's state to continue\n"
    with pytest.raises(SystemExit) as exited:  # argparse's own error: one line too
        cli.main(sync_argv("--resume", "--resume-if-present", state_dir=state))
    assert exited.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_resume_if_present_starts_a_new_run_in_an_empty_state_dir(inproc_sync, tmp_path, caplog):
    import logging

    state = tmp_path / "state"
    with caplog.at_level(logging.INFO, logger="ddiloco.sync"):
        inproc_sync(tiny(), ServiceOptions(state_dir=state, resume=Resume.IF_PRESENT)).close()
    assert f"no checkpoint in {state}: starting a new run" in caplog.text
    with pytest.raises(ConfigError, match="already holds a run's state"):  # a new run would overwrite it
        SyncService(tiny(), ServiceOptions(state_dir=state))


def wait_for_version(s, fragment: int, version: int) -> None:
    """Until the synchronizer merged ``fragment`` up to ``version`` (a contribution from it is current);
    fails naming what it waited for at the deadline (issue 58: it used to time out silently)."""
    wait_for(lambda: s.service.view.versions[fragment] >= version, f"fragment {fragment} at version {version}",
             timeout_s=30, poll_s=0.01)


def versions_received(stream, count: int) -> list[tuple[int, int]]:
    received = []
    for update in stream:
        received.append((update.fragment, update.version))
        if len(received) == count:
            stream.cancel()
    return received


def test_a_resubscribing_learner_gets_the_updates_it_missed_replayed(inproc_sync):
    s = inproc_sync(tiny())
    with SyncClient(f"127.0.0.1:{s.port}") as client:
        session = client.join(Join("learner-0", "boot")).state.session
        client.contribute(make_contribution(s.service, "learner-0", session, 0, 0))
        assert versions_received(client.updates("learner-0", [0, 0, 0], session), 1) == [(0, 1)]
        for seq in range(1, 3):  # while its stream is down
            wait_for_version(s, 0, seq)
            client.contribute(make_contribution(s.service, "learner-0", session, 0, seq, base_version=seq))
        assert versions_received(client.updates("learner-0", [1, 0, 0], session), 2) == [(0, 2), (0, 3)]
        # A learner from another incarnation of the synchronizer must join again first.
        with pytest.raises(CallRefused) as info:
            list(client.updates("learner-0", [0, 0, 0], Session(session.incarnation + 1, session.number)))
        assert info.value.reason == "unknown_learner"


def test_a_joined_learners_stream_starts_where_its_state_ends_however_late_it_calls(inproc_sync):
    """The stream opens when the state goes out: more updates made before the learner's call than
    the replay log keeps (a long transfer on a slow link) still all reach it, in order, and no gap
    sends it to join again (a rejoin loop in a chaos run on a 5 Mbit/s link)."""
    s = inproc_sync(tiny())
    late = REPLAY_UPDATES + 4
    with SyncClient(f"127.0.0.1:{s.port}") as client:
        session = client.join(Join("learner-0", "boot")).state.session
        for seq in range(late):
            wait_for_version(s, 0, seq)
            client.contribute(make_contribution(s.service, "learner-0", session, 0, seq, base_version=seq))
        received = versions_received(client.updates("learner-0", [0, 0, 0], session), late)
        assert received == [(0, v) for v in range(1, late + 1)]


def test_sync_time_is_observed_once_a_listening_stream_has_written_the_update(inproc_sync):
    """ξ_sync (core/shared/grace.py) runs from the event that closes a round until the last recipient's
    stream has written its update; with nobody listening there is nothing to observe."""
    s = inproc_sync(tiny())
    with SyncClient(f"127.0.0.1:{s.port}") as client:
        session = client.join(Join("learner-0", "boot")).state.session
        client.contribute(make_contribution(s.service, "learner-0", session, 0, 0))
        assert client.status_dict()["grace"]["sync_s"] == 0  # merged, but no stream to write it
        stream = client.updates("learner-0", [0, 0, 0], session)
        updates = iter(stream)
        first = next(updates)  # replayed: the stream is live
        assert (first.fragment, first.version) == (0, 1)
        client.contribute(make_contribution(s.service, "learner-0", session, 0, 1, base_version=1))
        second = next(updates)
        assert (second.fragment, second.version) == (0, 2)
        wait_for(lambda: client.status_dict()["grace"]["sync_s"] > 0, "ξ_sync measured", timeout_s=30, poll_s=0.01)
        stream.cancel()


def test_status_command_prints_the_documented_json(inproc_sync, capsys):
    import json

    from ddiloco import cli

    s = inproc_sync(tiny())
    with SyncClient(f"127.0.0.1:{s.port}") as client:
        session = client.join(Join("learner-0", "boot")).state.session
        client.contribute(make_contribution(s.service, "learner-0", session, 1, 0))
    assert cli.main(["status", f"127.0.0.1:{s.port}", "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert {"learners", "fragments", "bytes_up", "bytes_down", "uptime"} <= set(status)
    (lr,) = status["learners"]
    assert {"id", "alive", "accepted", "rejected"} <= set(lr) and lr["accepted"] == 1 and lr["alive"]
    assert [f["id"] for f in status["fragments"]] == [0, 1, 2]
    assert [f["version"] for f in status["fragments"]] == [0, 1, 0]
    assert status["bytes_up"] > 0 and status["bytes_down"] > 0 and status["uptime"] >= 0
    assert cli.main(["status", f"127.0.0.1:{s.port}"]) == 0  # the tables
    assert "learner-0" in capsys.readouterr().out


def test_status_of_a_synchronizer_that_is_not_there_is_one_line(capsys):
    from ddiloco import cli
    from ddiloco.testing import free_port

    assert cli.main(["status", f"127.0.0.1:{free_port()}", "--timeout", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ddiloco: error: cannot reach the synchronizer") and err.count("\n") == 1


def test_tls_with_a_self_signed_certificate(tmp_path):
    import shutil
    import subprocess

    from ddiloco.runtime.auth import Address, server_credentials
    from ddiloco.testing import InProcessSync

    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True)
    s = InProcessSync(tiny(), ServiceOptions(), listen=Address("127.0.0.1", 0),
                      credentials=server_credentials(str(cert), str(key)))
    try:
        with SyncClient(f"127.0.0.1:{s.port}", tls_ca=str(cert)) as client:
            assert client.join(Join("learner-0", "boot")).header.data_shard == 0
        with SyncClient(f"127.0.0.1:{s.port}") as plaintext, pytest.raises(Exception):
            plaintext.status(timeout_s=3)
    finally:
        s.close()


def test_serving_your_own_model_from_its_saved_initial_weights(tmp_path):
    from ddiloco.runtime.layout import layout_from_file
    from ddiloco.runtime.learner.runtime import save_initial_state
    from ddiloco.testing import InProcessSync

    torch.manual_seed(0)

    class Toy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(32, 16)
            self.hidden = torch.nn.Linear(16, 16)
            self.out = torch.nn.Linear(16, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(torch.relu(self.hidden(self.embed(x))))

    model = Toy()
    save_initial_state(model, tmp_path / "init.safetensors")
    config = tiny()
    layout = layout_from_file(tmp_path / "init.safetensors", config.protocol)
    assert [f.is_embedding for f in layout.plan.fragments] == [True, False, False]
    s = InProcessSync(config, ServiceOptions(), layout=layout)
    try:
        runtime = LearnerRuntime(model, f"127.0.0.1:{s.port}", "mine")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(2 * config.protocol.period):
            x = torch.randint(0, 32, (8,))
            loss = torch.nn.functional.cross_entropy(model(x), x)
            opt.zero_grad()
            loss.backward()
            opt.step()
            runtime.step(tokens=8)
        runtime.close()
        with SyncClient(f"127.0.0.1:{s.port}") as client:
            assert min(client.fetch_state().versions()) >= 1
    finally:
        s.close()


def test_a_hostile_member_cannot_freeze_the_run_move_its_budget_or_grow_its_ledgers(inproc_sync):
    """Issue 12's findings 1-4 and 8 against a live service: each message is refused with its
    reason and the run goes on merging an honest learner's work."""

    config = tiny()
    s = inproc_sync(config, ServiceOptions(token=TOKEN))
    sync = s.service
    client = SyncClient(f"127.0.0.1:{s.port}", token=TOKEN)
    session = client.join(Join("intruder", "boot")).state.session
    numel0 = sync.layout.plan.fragments[0].numel
    payload = get_codec("int4").encode(torch.full((numel0,), 1e-3))

    def chunk(**header):
        fields = dict(learner_id="intruder", session=wire.session_to_pb(session), fragment=0, tokens=256, steps=1,
                      compute_s=0.01, step_time_s=0.01, codec="int4", payload_bytes=len(payload))
        return [pb.ContributionChunk(header=pb.ContributionHeader(**{**fields, **header}), data=payload)]

    def beat(learner_id, tokens, steps=1):
        return pb.HeartbeatRequest(learner_id=learner_id, session=wire.session_to_pb(session),
                                   progress=pb.Progress(boot="boot", tokens=tokens, steps=steps))

    malformed = [
        lambda: client.contribute_chunks(chunk(tokens=0)),  # 1: froze every merge
        lambda: client.contribute_chunks(chunk(compute_s=1e300)),  # 7: goodput 1e298
        lambda: client.contribute_chunks(chunk(step_time_s=-1e300)),  # 7: grace window forced to 0
        lambda: client._call("Heartbeat", beat("intruder", 2**64 - 1, 2**63)),  # 3: int64 overflow
        lambda: client._call("Heartbeat", beat("x" * 100_000, 1)),  # 4, 5, 8: megabyte ids
        lambda: client.contribute_chunks(chunk(learner_id="y" * 100_000)),
    ]
    for call in malformed:
        err = refused(call)
        assert err.reason == "malformed", err.detail
        assert len(err.detail) < 1000  # the reason survives a standard client's metadata limit
    # 2: a heartbeat from no registered session, claiming a run's worth of tokens.
    assert refused(lambda: client._call("Heartbeat", beat("ghost", 10**9, 10**6))).reason == "unknown_learner"
    status = client.status_dict()
    assert status["tokens"] == 0 and status["rejections"] == {"malformed": 6, "unknown_learner": 1}
    assert all(len(lr["id"]) < 100 for lr in status["learners"])
    assert all(len(str(row[0])) < 100 for row in sync.ledger.state_dict())

    # The honest learner's work is still merged: the core host's timer is alive.
    workload = Workload.build(config)
    model = workload.new_model()
    runtime = LearnerRuntime(model, f"127.0.0.1:{s.port}", "learner-0", token=TOKEN)
    _train(runtime, workload, model, 0, 3 * config.protocol.period)
    runtime.close()
    # The intruder holds a lease and never contributes: the rounds close when their grace window ends.
    wait_for(lambda: all(f["version"] >= 1 for f in client.status_dict()["fragments"]), "every fragment to merge")
    client.close()


def test_a_timer_that_fails_is_logged_and_stops_the_service_loudly(inproc_sync, caplog):
    """Finding 1's second half: a failure in the core host's timer used to end it without a
    log line, leaving a service that answered but never expired a lease or closed a round."""

    s = inproc_sync(tiny())
    host = s.service.host

    def broken(*_: object) -> None:
        raise RuntimeError("a bug in the core")

    s.service.core.next_deadline = broken  # the fault: the next question the timer asks raises
    with caplog.at_level("CRITICAL", logger="ddiloco.sync"):
        s.loop.call_soon_threadsafe(host._wake.set)
        wait_for(lambda: host.crashed.is_set(), "the host to report its failure")
    assert isinstance(host.failure, RuntimeError)
    assert any("timer failed" in r.getMessage() and r.exc_info for r in caplog.records)


def test_an_idle_synchronizer_sleeps_between_ticks(inproc_sync, monkeypatch):
    """The timer's own Tick set the wake it then waited on, so an idle synchronizer ticked about a
    thousand times a second and took a core from the learners beside it. Three Ticks of a core
    with no deadline now take at least two full waits (a wait ends early only on an event)."""
    import time

    from ddiloco.core.shared.actions import Tick
    from ddiloco.runtime.sync import core_host

    monkeypatch.setattr(core_host, "TIMER_MAX_WAIT_S", 0.2)
    s = inproc_sync(tiny())
    ticks: list[float] = []
    handle = s.service.core.handle

    def counted(event, now):
        if isinstance(event, Tick):
            ticks.append(time.monotonic())
        return handle(event, now)

    s.service.core.handle = counted
    wait_for(lambda: len(ticks) >= 3, "three ticks of an idle synchronizer")
    assert ticks[2] - ticks[0] >= 2 * 0.2 * 0.99
