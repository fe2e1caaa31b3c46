"""chaos.json from a synthetic outcome: pauses across restarts, rejections across incarnations, rejoins, verdicts."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ddiloco.chaos.outcome import ChaosOutcome, FaultRecord, Sample, ShardCounts, SyncRecovery
from ddiloco.chaos.report import build_report, plot_timeline, rejections, rejoins_by_learner, write_events
from ddiloco.chaos.schedule import Fault
from ddiloco.settings.config_sources import build_config
from ddiloco.settings.fault_kinds import FaultKind


def sample(t: float, instance: str, versions: tuple[int, ...], *, alive: tuple[bool, ...] = (True, True),
           pause: float = 0.1, rejected: dict[str, int] | None = None, phase: str = "running",
           registered: tuple[int, ...] = (1, 1), refused_steps: dict[str, int] | None = None) -> Sample:
    counts = ShardCounts(instance, rejected or {}, {f"learner-{i}": n for i, n in enumerate(registered)},
                         refused_steps or {})
    return Sample(t_s=t, instance_id=instance, phase=phase, versions=versions,
                  alive={f"learner-{i}": a for i, a in enumerate(alive)}, tokens=100 * int(t), grace_window_s=0.2,
                  longest_pause_s=pause, shards=(counts,))


def outcome(tmp_path: Path, samples: list[Sample], records: list[FaultRecord],
            restarts: list[SyncRecovery]) -> ChaosOutcome:
    return ChaosOutcome(completed=True, failure="", records=records, samples=samples, sync_restarts=restarts,
                        final_status={"goodput": 0.8, "model_uptime": 0.9, "tokens": 5000,
                                      "fragments": [{"version": 9}, {"version": 8}]},
                        eval_loss=2.0, wall_s=60.0, status_url="http://127.0.0.1:1/")


def test_a_run_within_its_bound_has_no_violation_and_counts_across_incarnations(tmp_path) -> None:
    config = build_config(preset="tiny", overrides=("run.learners=2", "protocol.lease_s=3"))
    kill = FaultRecord(Fault(at_s=2, kind=FaultKind.SYNC_CRASH, target="sync", duration_s=1), started_s=2.0,
                       ended_s=3.0)
    restart = SyncRecovery(target="sync", killed_at_s=2.0, versions_at_kill=(5, 5), tokens_at_kill=200,
                          answering_at_s=6.0, versions_resumed=(3, 4), tokens_resumed=150, first_merge_after_s=1.5)
    samples = [sample(0, "a", (0, 0)),
               sample(1, "a", (5, 5), pause=0.4, rejected={"stale": 2}, refused_steps={"stale": 60}),
               sample(6, "b", (3, 4), pause=0.0, rejected={"stale": 1, "unknown_learner": 2},
                      refused_steps={"stale": 30, "unknown_learner": 40}),
               sample(8, "b", (9, 8), pause=0.3, rejected={"stale": 1, "unknown_learner": 4}, registered=(2, 2),
                      refused_steps={"stale": 30, "unknown_learner": 90})]
    report = build_report(outcome(tmp_path, samples, [kill], [restart]), config, window_s=10, seed=3, baseline=None)
    assert report["faults"]["sync_crash"] == 1 and sum(report["faults"].values()) == 1
    assert report["longest_pause_s"] == 1.5  # the restart's own pause is the longest
    assert report["pause_bound_s"] == 3.2 and report["sync_downtime_s"] == 4.0
    assert report["sync_restarts"][0]["rounds_lost"] == 3
    # 4 after the restart (restored 0 of them is unknowable) plus the 1 stale lost to the crash.
    assert report["rejected"] == {"stale": 2, "unknown_learner": 4}
    # The ledger's steps the same way; only the stale ones are honest work thrown away (core/sync_side/refusals.py).
    assert report["refused_steps"] == {"stale": 60, "unknown_learner": 90}
    assert report["honest_refused_steps"] == 60
    assert report["rejoins"] == 2 and report["learners_alive_at_end"] == 2 and report["violations"] == []
    plot_timeline(tmp_path / "chaos.png", outcome(tmp_path, samples, [kill], [restart]), 2, title="t")
    assert (tmp_path / "chaos.png").stat().st_size > 0
    write_events(tmp_path, samples)  # what tensorboard --logdir shows: the samples, step = tokens
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("fragment_versions/1")] == [(0, 0), (100, 5), (600, 4), (800, 8)]
    assert [e.value for e in events.Scalars("learners_alive")] == [2, 2, 2, 2]


def test_each_broken_property_is_named(tmp_path) -> None:
    config = build_config(preset="tiny", overrides=("run.learners=2", "protocol.lease_s=3"))
    left = FaultRecord(Fault(at_s=1, kind=FaultKind.LEARNER_CRASH, target="learner-1", duration_s=0, restart=False),
                       started_s=1.0)
    samples = [sample(0, "a", (0, 0)), sample(9, "a", (1, 1), alive=(False, False), pause=7.5)]
    report = build_report(outcome(tmp_path, samples, [left], []), config, window_s=10, seed=0, baseline=None)
    assert report["learners_expected_at_end"] == 1  # learner-1 was left down on purpose
    assert report["violations"] == ["learners alive at the end: 0 of 1 expected",
                                    "longest pause without a merge 7.50s exceeds the bound 3.20s "
                                    "(grace window + lease)"]


def test_rejections_and_rejoins_of_one_incarnation(tmp_path) -> None:
    assert rejections([sample(0, "a", (0,), rejected={"stale": 3, "duplicate": 0})]) == {"stale": 3}
    assert rejoins_by_learner([sample(0, "a", (0,), registered=(1, 3))]) == {"learner-0": 0, "learner-1": 2}
    assert rejoins_by_learner([]) == {}


def test_a_learner_that_rejoins_far_more_often_than_its_faults_explain_fails_the_verdict(tmp_path) -> None:
    """Issue 29, item 1: ten rejoins of learner-1 under one latency fault, and the verdict said ok."""
    config = build_config(preset="tiny", overrides=("run.learners=2", "protocol.lease_s=3"))
    latency = FaultRecord(Fault(at_s=1, kind=FaultKind.LATENCY, target="learner-1", duration_s=5, delay_s=0.205),
                          started_s=1.0, ended_s=6.0)
    samples = [sample(0, "a", (0, 0)), sample(9, "a", (9, 9), registered=(1, 11))]
    report = build_report(outcome(tmp_path, samples, [latency], []), config, window_s=10, seed=0, baseline=None)
    assert report["rejoins"] == 10 and report["rejoins_by_learner"] == {"learner-0": 0, "learner-1": 10}
    assert report["rejoins_explained"] == {"learner-0": 0, "learner-1": 1}
    assert report["violations"] == ["learner-1 rejoined 10 times, 1 explained by faults (a rejoin loop)"]
    samples[-1] = sample(9, "a", (9, 9), registered=(1, 2))
    once = outcome(tmp_path, samples, [latency], [])
    assert build_report(once, config, window_s=10, seed=0, baseline=None)["violations"] == []  # one per fault


def test_counts_across_incarnations_keep_what_a_crash_lost_and_what_the_registry_forgot() -> None:
    a = [sample(0, "a", (0,), registered=(1, 1)), sample(1, "a", (0,), registered=(3, 2)),
         sample(2, "a", (0,), registered=(3, 2))]
    a[-1] = replace(a[-1], shards=(ShardCounts("a", {}, {"learner-1": 2}),))  # learner-0 forgotten, at its peak
    b = [sample(5, "b", (0,), registered=(2, 2)), sample(6, "b", (0,), registered=(3, 3))]
    # a: learner-0 reached 3 (its checkpoint kept 2), learner-1 reached 2 (kept 2); b adds one each.
    assert rejoins_by_learner(a + b) == {"learner-0": 3, "learner-1": 2}


def test_a_reworded_synchronizer_log_does_not_change_the_rejoin_count(monkeypatch, caplog) -> None:
    """Rejoins came from a regex over a log line of service.py: rewording it made chaos.json say 0."""
    import logging

    import ddiloco.runtime.sync.service as service_module
    from ddiloco.core.shared.messages import Join
    from ddiloco.runtime.client import SyncClient
    from ddiloco.runtime.sharded import merge_statuses
    from ddiloco.runtime.sync.service import ServiceOptions
    from ddiloco.testing import InProcessSync

    original = service_module.log.info
    monkeypatch.setattr(service_module.log, "info",
                        lambda msg, *args: original(msg.replace("learner %s %s (", "member %s %s ["), *args))
    sync = InProcessSync(build_config(preset="tiny", overrides=("run.learners=2",)), ServiceOptions())
    try:
        with caplog.at_level(logging.INFO, logger="ddiloco.sync"), SyncClient(f"127.0.0.1:{sync.port}") as client:
            client.join(Join("learner-0", "boot-0"))
            for _ in range(3):
                client.join(Join("learner-1", "boot-1"))
            status = client.status_dict()
    finally:
        sync.close()
    assert "member learner-1 rejoined [" in caplog.text and "learner learner-1 rejoined (" not in caplog.text
    assert rejoins_by_learner([Sample.from_status(0.0, status)]) == {"learner-0": 0, "learner-1": 2}
    # Sharded: every shard's registrations, each shard's own (not the first shard's for all).
    other = {**status, "learners": [{**lr, "registrations": 7} for lr in status["learners"]]}
    merged = Sample.from_status(0.0, merge_statuses([status, other]))
    assert [c.registrations for c in merged.shards] == [{"learner-0": 1, "learner-1": 3},
                                                        {"learner-0": 7, "learner-1": 7}]
    assert rejoins_by_learner([merged]) == {"learner-0": 0 + 6, "learner-1": 2 + 6}


def sharded(t: float, ids: tuple[str, str], registered: tuple[tuple[int, ...], tuple[int, ...]],
            rejected: tuple[dict[str, int], dict[str, int]] = ({}, {})) -> Sample:
    """A sample of a synchronizer of two shards, each process with its own incarnation and counters."""
    shards = tuple(ShardCounts(i, r, {f"learner-{k}": n for k, n in enumerate(regs)})
                   for i, regs, r in zip(ids, registered, rejected))
    return replace(sample(t, ",".join(ids), (0, 0), alive=(True,) * 3), shards=shards)


def test_rejoins_and_rejections_count_every_shard_each_across_its_own_restarts(tmp_path) -> None:
    """docs/results/chaos_shard_kills_round_log.json said 0 rejoins after 10 kills of shard 1: only the
    first shard's registrations were read. Here shard 1 is killed twice, shard 0 never, 3 learners."""
    config = build_config(preset="tiny", overrides=("run.learners=3", "protocol.lease_s=3", "protocol.shards=2"))
    samples = [sharded(0, ("a0", "a1"), ((1, 1, 1), (1, 1, 1)), ({}, {"stale": 1})),
               sharded(1, ("a0", "a1"), ((1, 1, 1), (1, 1, 1)), ({}, {"stale": 3})),  # checkpointed at 1
               sharded(5, ("a0", "b1"), ((1, 1, 2), (1, 1, 1)), ({}, {"stale": 1, "unknown_learner": 1})),
               sharded(6, ("a0", "b1"), ((1, 1, 2), (2, 2, 2)), ({"stale": 2}, {"stale": 1, "unknown_learner": 3})),
               sharded(9, ("a0", "c1"), ((1, 1, 2), (2, 2, 2)), ({"stale": 2}, {"stale": 1, "unknown_learner": 3})),
               sharded(10, ("a0", "c1"), ((1, 1, 2), (3, 3, 3)), ({"stale": 2}, {"stale": 1, "unknown_learner": 6}))]
    # Each learner rejoined both new incarnations of shard 1; learner-2 rejoined shard 0 after its kill too.
    assert rejoins_by_learner(samples) == {"learner-0": 2, "learner-1": 2, "learner-2": 3}
    # shard 1: stale 3 lost 2 to the first crash (its checkpoint held 1), unknown_learner 6; shard 0: stale 2.
    assert rejections(samples) == {"stale": 2 + 1 + 2, "unknown_learner": 6}
    kills = [SyncRecovery(target="sync-1", killed_at_s=t, versions_at_kill=(1,), tokens_at_kill=0, answering_at_s=t + 1)
             for t in (2.0, 7.0)]
    crash = FaultRecord(Fault(at_s=3, kind=FaultKind.LEARNER_CRASH, target="learner-2", duration_s=1),
                        started_s=3.0, ended_s=4.0)
    run = replace(outcome(tmp_path, samples, [crash], kills), sync_names=("sync-0", "sync-1"))
    report = build_report(run, config, window_s=10, seed=0, baseline=None)
    assert report["rejoins"] == 7 and report["violations"] == []
    # Two shard restarts each, and learner-2's kill makes it join both shards again.
    assert report["rejoins_explained"] == {"learner-0": 2, "learner-1": 2, "learner-2": 4}


def test_a_fault_the_run_ended_before_is_said_not_judged(tmp_path) -> None:
    config = build_config(preset="tiny", overrides=("run.learners=2",))
    done = FaultRecord(Fault(at_s=1, kind=FaultKind.PARTITION, target="learner-0", duration_s=1), started_s=1.0,
                       ended_s=2.0)
    late = FaultRecord(Fault(at_s=10, kind=FaultKind.RESET, target="learner-1", duration_s=1))
    report = build_report(outcome(tmp_path, [sample(0, "a", (0, 0)), sample(9, "a", (1, 1))], [done, late], []),
                          config, window_s=12, seed=0, baseline=None)
    assert report["not_reached"] == ["reset learner-1 for 1.0s at 10.0s"] and report["violations"] == []
    assert report["faults"]["reset"] == 0 and report["faults"]["partition"] == 1
