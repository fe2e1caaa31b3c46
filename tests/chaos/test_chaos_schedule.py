"""Schedules: the TOML file, its validation (one ConfigError naming the entry), the seeded default."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddiloco.chaos.schedule import Fault, check_targets, load_schedule, seeded_schedule
from ddiloco.core.shared.errors import ConfigError
from ddiloco.settings.fault_kinds import REAL, FaultKind


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "schedule.toml"
    path.write_text(text)
    return path


def test_schedule_file_is_read_sorted_and_round_trips(tmp_path) -> None:
    path = write(tmp_path, """
[[fault]]
time = 20
fault = "latency"
target = "learner-0"
duration = 5
delay_s = 0.2

[[fault]]
time = 3.5
fault = "sync_crash"
duration = 2

[[fault]]
time = 10
fault = "learner_crash"
target = "learner-1"
duration = 4
restart = false
""")
    faults = load_schedule(path)
    assert [f.kind for f in faults] == [FaultKind.SYNC_CRASH, FaultKind.LEARNER_CRASH, FaultKind.LATENCY]
    assert faults[0].target == "sync" and faults[0].end_s == 5.5
    assert not faults[1].restart and faults[2].delay_s == 0.2
    check_targets(faults, learners=2, window_s=30)
    again = write(tmp_path, "\n".join("[[fault]]\n" + "\n".join(f"{k} = {json.dumps(v)}" for k, v in f.to_dict().items())
                                       for f in faults))
    assert load_schedule(again) == faults


@pytest.mark.parametrize("body, message", [
    ('time = 1\nfault = "explode"\ntarget = "learner-0"', "unknown fault kind 'explode'"),
    ('time = -1\nfault = "learner_crash"\ntarget = "learner-0"', "time must be a finite number >= 0"),
    ('time = 1\nfault = "bandwidth"\ntarget = "learner-0"\nduration = 3\nrate_bytes_per_s = -5', "rate_bytes_per_s"),
    ('time = 1\nfault = "bandwidth"\ntarget = "learner-0"\nduration = 3', "rate_bytes_per_s must be > 0"),
    ('time = 1\nfault = "latency"\ntarget = "learner-0"\nduration = 3', "delay_s must be > 0"),
    ('time = 1\nfault = "freeze"\ntarget = "learner-0"', "duration must be > 0"),
    ('time = 1\nfault = "learner_crash"\ntarget = "learner-0"\nspeed = 3', "unknown key 'speed'"),
    ('fault = "learner_crash"\ntarget = "learner-0"', "missing key 'time'"),
    ('time = "soon"\nfault = "learner_crash"\ntarget = "learner-0"', "time must be a number"),
    ('time = 1\nfault = "learner_crash"', "target must be a learner id"),
    ('time = 1\nfault = "learner_crash"\ntarget = "sync"', "only sync_crash targets the synchronizer"),
    ('time = 1\nfault = "sync_crash"\ntarget = "learner-0"', "target must be 'sync'"),
    ('time = 1\nfault = "freeze"\ntarget = "learner-0"\nduration = 2\nrestart = false', "applies to learner_crash only"),
])
def test_a_bad_entry_is_one_error_naming_the_file_and_entry(tmp_path, body, message) -> None:
    path = write(tmp_path, f'[[fault]]\ntime = 0\nfault = "reset"\ntarget = "learner-0"\n\n[[fault]]\n{body}\n')
    with pytest.raises(ConfigError, match="fault 2: .*" + message.replace("(", r"\(").replace(")", r"\)")) as err:
        load_schedule(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("text, message", [
    ("[[fault]\ntime = 1", "is not valid TOML"),
    ("fault = 3", "array of tables"),
    ("[faults]\ntime = 1", "unknown top-level key 'faults'"),
])
def test_a_malformed_file_is_one_error(tmp_path, text, message) -> None:
    with pytest.raises(ConfigError, match=message):
        load_schedule(write(tmp_path, text))


def test_a_missing_file_is_one_error(tmp_path) -> None:
    with pytest.raises(ConfigError, match="schedule file not found"):
        load_schedule(tmp_path / "nope.toml")


def test_targets_must_exist_and_faults_end_inside_the_window() -> None:
    kill = Fault(at_s=1, kind=FaultKind.LEARNER_CRASH, target="learner-3", duration_s=2)
    with pytest.raises(ConfigError, match="targets 'learner-3', which does not exist.*learner-0 .. learner-2"):
        check_targets([kill], learners=3, window_s=60)
    late = Fault(at_s=55, kind=FaultKind.FREEZE, target="learner-0", duration_s=10)
    with pytest.raises(ConfigError, match="ends at 65s, after --time 60"):
        check_targets([late], learners=3, window_s=60)


@pytest.mark.parametrize("seed", range(8))
def test_the_seeded_schedule_injects_every_kind_in_180s_one_fault_at_a_time(seed) -> None:
    faults = seeded_schedule(window_s=180, learners=3, lease_s=10, fragment_bytes=5_000, seed=seed)
    assert {f.kind for f in faults} == set(REAL)
    check_targets(faults, learners=3, window_s=180)
    for before, after in zip(faults, faults[1:]):
        assert after.at_s > before.end_s  # never two at once: a learner is always healthy
    assert all(f.duration_s > 10 for f in faults if f.kind is FaultKind.FREEZE)  # outlasts the lease
    assert faults == seeded_schedule(window_s=180, learners=3, lease_s=10, fragment_bytes=5_000, seed=seed)


def test_seeds_draw_different_schedules() -> None:
    drawn = {tuple(seeded_schedule(window_s=180, learners=3, lease_s=10, fragment_bytes=5_000, seed=s))
             for s in range(5)}
    assert len(drawn) == 5


def test_a_sharded_run_names_the_shard_it_kills() -> None:
    kill = Fault(at_s=1, kind=FaultKind.SYNC_CRASH, target="sync-1", duration_s=1)
    check_targets([kill], learners=2, window_s=60, shards=2)
    with pytest.raises(ConfigError, match="targets 'sync', which does not exist.*sync-0 .. sync-1"):
        check_targets([Fault(at_s=1, kind=FaultKind.SYNC_CRASH, target="sync", duration_s=1)], 2, 60, shards=2)
    with pytest.raises(ConfigError, match="targets 'sync-1', which does not exist.*synchronizer is sync\\)"):
        check_targets([kill], learners=2, window_s=60)
    with pytest.raises(ConfigError, match="only sync_crash targets the synchronizer"):
        Fault(at_s=1, kind=FaultKind.FREEZE, target="sync-0", duration_s=1)
    faults = seeded_schedule(window_s=600, learners=3, lease_s=10, fragment_bytes=5_000, seed=1, shards=2)
    check_targets(faults, learners=3, window_s=600, shards=2)
    assert {f.target for f in faults if f.kind is FaultKind.SYNC_CRASH} == {"sync-0", "sync-1"}
