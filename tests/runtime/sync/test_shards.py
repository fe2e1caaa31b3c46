"""A synchronizer sharded by fragment: each shard owns p mod N; learners join every shard.

The in-process tests check what a learner refuses; the real-process test kills one shard of
two with kill -9 and restarts it with --resume.
"""

from __future__ import annotations

import pytest

from ddiloco import cli
from ddiloco.core.shared.errors import ConfigError
from ddiloco.runtime.learner.runtime import LearnerRuntime
from ddiloco.runtime.sync.service import ServiceOptions
from ddiloco.settings.config_sources import build_config
from ddiloco.testing import InProcessSync, free_port, status_of, sync_args, sync_argv, train_steps, wait_for
from ddiloco.workload.workload import Workload


def sharded(**extra: str) -> object:
    sets = ("run.learners=2", "protocol.shards=2") + tuple(f"{k}={v}" for k, v in extra.items())
    return build_config(preset="tiny", overrides=sets)


@pytest.fixture
def two_shards():
    config = sharded()
    shards = [InProcessSync(config, ServiceOptions(shard=i)) for i in range(2)]
    try:
        yield config, shards
    finally:
        for s in shards:
            s.close()


def test_each_shard_owns_its_fragments_and_a_learner_trains_against_both(two_shards):
    config, shards = two_shards
    assert [s.service.core.owned for s in shards] == [(0, 2), (1,)]
    workload = Workload.build(config)
    model = workload.new_model()
    addresses = ",".join(f"127.0.0.1:{s.port}" for s in reversed(shards))  # any order
    runtime = LearnerRuntime(model, addresses, "learner-0")
    train_steps(runtime, workload, model, 0, 3 * config.protocol.period)
    runtime.close()
    for s in shards:
        status = s.call(lambda s=s: s.service.status_reply())
        assert [f.id for f in status.fragments] == list(s.service.core.owned)
        assert all(f.version >= 1 for f in status.fragments)
        (lr,) = status.learners
        # Each fragment's work arrived (a fragment's next send waits for its update: how many more is timing).
        assert lr.accepted >= len(s.service.core.owned) and lr.tokens == 3 * config.protocol.period * workload.tokens_per_step


def test_addresses_that_do_not_form_one_run_are_refused_before_training(two_shards):
    config, shards = two_shards
    model = Workload.build(config).new_model()
    a, b = (f"127.0.0.1:{s.port}" for s in shards)
    with pytest.raises(ConfigError, match="2 shard"):
        LearnerRuntime(model, a, "learner-0")  # one shard of two
    with pytest.raises(ConfigError, match="both serve shard 0"):
        LearnerRuntime(model, f"{a},{a}", "learner-0")
    other = InProcessSync(sharded(**{"protocol.outer_lr": 0.3}), ServiceOptions(shard=1))
    try:
        with pytest.raises(ConfigError, match="different runs"):
            LearnerRuntime(model, f"{a},127.0.0.1:{other.port}", "learner-0")
    finally:
        other.close()
    for s in shards:  # nobody was registered by the refused attempts
        assert s.call(lambda s=s: s.service.status_reply()).learners == []


@pytest.mark.parametrize("bad", ["2/2", "1/0", "x", "0-2"])
def test_a_bad_shard_is_one_line(bad, capsys):
    code = cli.main(sync_argv("--shard", bad))
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("ddiloco: error: --shard") and err.count("\n") == 1


def test_a_shard_conflicting_with_the_configuration_is_one_line(capsys):
    code = cli.main(sync_argv("--shard", "0/2", sets=["protocol.shards=3"]))
    assert code == 2 and "conflicts with protocol.shards=3" in capsys.readouterr().err


@pytest.mark.slow
def test_one_shard_killed_9_the_other_keeps_merging_and_the_restart_is_rejoined(procs, tmp_path) -> None:
    ports = [free_port(), free_port()]
    common = ["--tokens", str(10**9), "--set", "protocol.shards=2", "--checkpoint-every-rounds", "1"]
    args = [sync_args(p, *common, "--shard", f"{i}/2", "--state-dir", str(tmp_path / f"state-{i}"))
            for i, p in enumerate(ports)]
    for i in range(2):
        procs.start(f"sync{i}", *args[i])
    connect = ",".join(f"127.0.0.1:{p}" for p in ports)
    for i in range(2):
        procs.start(f"l{i}", "learner", "--connect", connect, "--id", f"learner-{i}", "--threads", "1",
                    "--min-step-s", "0.02")

    def versions(i: int) -> int:
        s = status_of(ports[i])
        return sum(f["version"] for f in s["fragments"]) if s else -1

    def contributing(i: int) -> bool:
        s = status_of(ports[i])
        return bool(s) and len(s["learners"]) == 2 and all(lr["accepted"] >= 2 for lr in s["learners"])

    wait_for(lambda: contributing(0) and contributing(1), "both learners contributing to both shards")
    known = status_of(ports[1])["checkpoints"]
    # Checkpoints (one per round) begun after both learners were known to shard 1.
    wait_for(lambda: status_of(ports[1])["checkpoints"] >= known + 2, "shard 1 checkpointing")
    procs.kill9("sync1")
    before = versions(0)
    wait_for(lambda: versions(0) >= before + 6, "shard 0's fragments to keep advancing while shard 1 is down")
    assert all(procs.procs[f"l{i}"].poll() is None for i in range(2))
    procs.start("sync1b", *args[1], "--resume")
    back = wait_for(lambda: (s := status_of(ports[1])) and all(
        lr["alive"] and lr["registrations"] >= 2 for lr in s["learners"]) and len(s["learners"]) == 2 and s,
        "every learner to rejoin the restarted shard by itself")
    resumed = sum(f["version"] for f in back["fragments"])
    wait_for(lambda: versions(1) >= resumed + 4, "the restarted shard to merge again")
    assert "joined synchronizer instance" in procs.log("l0")
