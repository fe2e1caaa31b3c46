"""The soak's pieces without processes (``chaos/soak.py``): its schedule, what it reads of /proc and of a
state directory, and how the promises are judged."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

from ddiloco.chaos.schedule import check_targets
from ddiloco.chaos.soak import (
    KILL_GAP_S,
    Promise,
    SoakSample,
    children_of,
    flat,
    judge,
    read_proc,
    soak_schedule,
    state_dir_size,
)
from ddiloco.runtime.sync.state_dir import FORMAT
from ddiloco.settings.fault_kinds import FaultKind


def test_the_schedule_spreads_kills_over_every_learner_and_puts_sync_kills_between_samples():
    faults, window_s = soak_schedule(kills=2000, sync_kills=20, learners=5, seed=3, sample_every=100, lease_s=3.0,
                                     freezes=20, partitions=20)
    check_targets(faults, 5, window_s)  # every target exists, every fault ends within the window
    kinds = collections.Counter(f.kind for f in faults)
    assert kinds == {FaultKind.LEARNER_CRASH: 2000, FaultKind.SYNC_CRASH: 20, FaultKind.FREEZE: 20,
                     FaultKind.PARTITION: 20}
    kills = [f for f in faults if f.kind is FaultKind.LEARNER_CRASH]
    assert set(collections.Counter(f.target for f in kills).values()) == {400}
    assert all(a.target != b.target for a, b in zip(kills, kills[1:]))  # never the same learner twice in a row
    for sync in (f for f in faults if f.kind is FaultKind.SYNC_CRASH):
        assert all(abs(sync.at_s - k.at_s) >= KILL_GAP_S / 2 - 1e-9 for k in kills)
    for pause in (f for f in faults if f.kind in (FaultKind.FREEZE, FaultKind.PARTITION)):
        before = max((k for k in kills if k.at_s <= pause.at_s), key=lambda k: k.at_s)
        after = min((k for k in kills if k.at_s > pause.at_s), key=lambda k: k.at_s)
        assert pause.target not in (before.target, after.target)


def test_one_sync_kill_in_a_short_soak_falls_between_the_second_and_the_last_sample():
    faults, _ = soak_schedule(kills=8, sync_kills=1, learners=5, seed=0, sample_every=2, lease_s=3.0,
                              freezes=1, partitions=1)
    kills = sorted(f.at_s for f in faults if f.kind is FaultKind.LEARNER_CRASH)
    (sync,) = [f for f in faults if f.kind is FaultKind.SYNC_CRASH]
    assert kills[3] < sync.at_s < kills[7]  # after kill 4 (the second sample), before kill 8 (the last)


def test_the_same_seed_gives_the_same_schedule_and_another_seed_another():
    args = dict(kills=50, sync_kills=2, learners=4, sample_every=10, lease_s=3.0, freezes=2, partitions=2)
    assert soak_schedule(seed=1, **args) == soak_schedule(seed=1, **args)
    assert soak_schedule(seed=1, **args) != soak_schedule(seed=2, **args)


def test_proc_figures_of_this_process_and_of_a_child_and_none_for_a_process_gone():
    me = read_proc(os.getpid())
    assert me is not None and me.rss_kib > 0 and me.hwm_kib >= me.rss_kib and me.fds >= 3 and me.threads >= 1
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        assert child.pid in children_of(os.getpid())
    finally:
        child.communicate(b"")
    assert read_proc(child.pid) is None


def test_settled_state_dir_bytes_leave_out_the_live_round_log_and_a_checkpoint_being_written(tmp_path: Path):
    (tmp_path / "CURRENT").write_text("checkpoint-000002")
    for name, size in (("checkpoint-000001", 1000), ("checkpoint-000002", 300), ("checkpoint-000003", 5000)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "fragment-00000.safetensors").write_bytes(b"x" * size)
    manifest = json.dumps({"format": FORMAT, "state": {"core": {}, "service": {"round_log_from": 3}}, "fragments": []})
    (tmp_path / "checkpoint-000002" / "manifest.json").write_text(manifest)
    (tmp_path / "rounds-00000002.log").write_bytes(b"r" * 70)   # held by checkpoint 2: a leak if never deleted
    (tmp_path / "rounds-00000003.log").write_bytes(b"r" * 900)  # since the checkpoint, its writer killed since
    (tmp_path / "rounds-00000004.log").write_bytes(b"r" * 400)  # the restarted writer's segment
    total, files, settled = state_dir_size(tmp_path)
    assert files == 8 and total == 17 + 1000 + 300 + len(manifest) + 5000 + 70 + 900 + 400
    assert settled == 17 + 1000 + 300 + len(manifest) + 70  # the old checkpoint and the held segment stay counted


def test_without_a_checkpoint_naming_its_segment_only_the_newest_segment_is_live(tmp_path: Path):
    (tmp_path / "rounds-00000000.log").write_bytes(b"r" * 70)
    (tmp_path / "rounds-00000001.log").write_bytes(b"r" * 900)
    assert state_dir_size(tmp_path) == (970, 2, 70)


def _sample(kills: int, rss: int, fds: int = 20, threads: int = 12, settled: int = 250_000) -> SoakSample:
    return SoakSample(kills=kills, sync_kills=0, t_s=0.0, quiet=True, sync_rss_kib=rss, sync_hwm_kib=rss,
                      sync_fds=fds, sync_threads=threads, status_page_rss_kib=None, state_dir_bytes=settled,
                      state_dir_files=7, state_dir_settled_bytes=settled, harness_rss_kib=None, learners_alive=5)


def test_flat_compares_the_last_sample_with_the_second_and_only_growth_breaks_it():
    samples = [_sample(100, 300_000), _sample(200, 400_000), _sample(300, 430_000)]
    assert flat(samples, "sync_rss_kib") is True  # +7.5% of the second: the first is warm-up
    assert flat(samples + [_sample(400, 441_000)], "sync_rss_kib") is False  # +10.25%
    assert flat(samples + [_sample(400, 200_000)], "sync_rss_kib") is True  # fell by half: a restart, no leak
    assert flat(samples[:1], "sync_rss_kib") is None


def _report(**changes) -> dict:
    report = {"learners_alive_at_end": 2, "learners": 2, "completed": True, "honest_refused_steps": 0,
              "batches_skipped": 0, "batches_retrained_beyond_period": 0,
              "sync_restarts": [{"answering_at_s": 9.0, "rounds_lost": 0}],
              "batches_by_learner": {"learner-0": {"processes": [[0, 50], [45, 90]]},
                                     "learner-1": {"processes": [[0, 80]]}}}
    return {**report, **changes}


def test_every_promise_held_and_each_broken_one_alone():
    samples = [_sample(k, 300_000) for k in (10, 20, 30)]
    assert all(judge(_report(), samples).values()) and set(judge(_report(), samples)) == set(Promise)
    broken = {
        Promise.LEARNERS_ALIVE_AND_TRAINING: _report(batches_by_learner={
            "learner-0": {"processes": [[0, 50], [45, 45]]}, "learner-1": {"processes": [[0, 80]]}}),
        Promise.BUDGET_REACHED: _report(completed=False),
        Promise.NO_MERGED_VERSION_LOST: _report(sync_restarts=[{"answering_at_s": 9.0, "rounds_lost": 3}]),
        Promise.NO_HONEST_STEP_REFUSED: _report(honest_refused_steps=12),
        Promise.NO_DATA_SKIPPED: _report(batches_skipped=1),
        Promise.RETRAINED_WITHIN_ONE_PERIOD_PER_KILL: _report(batches_retrained_beyond_period=9),
    }
    for promise, report in broken.items():
        judged = judge(report, samples)
        assert [p for p, held in judged.items() if not held] == [promise]
    grown = samples + [_sample(40, 300_000, fds=40)]
    assert [p for p, held in judge(_report(), grown).items() if not held] == [Promise.SYNC_FDS_FLAT]
