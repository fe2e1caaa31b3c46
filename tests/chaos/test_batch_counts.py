"""Batches trained again and skipped across a learner's restarts: the counting, its evidence, its verdict."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from ddiloco.chaos.batch_counts import count_batches
from ddiloco.chaos.outcome import ChaosOutcome
from ddiloco.chaos.report import build_report
from ddiloco.runtime.batch_log import BatchLog, ProcessBatches, read_batch_log
from ddiloco.settings.config_sources import build_config


def by_hand(processes: list[ProcessBatches], period: int, position: int) -> tuple[int, int, int]:
    """(retrained, beyond the period, skipped), one batch at a time."""
    times: Counter[int] = Counter()
    retrained = beyond = 0
    for p in processes:
        again = sum(1 for b in range(p.resumed_at, p.trained_to) if times[b])
        retrained += again
        beyond += max(0, again - period)
        times.update(range(p.resumed_at, p.trained_to))
    reached = max([position] + [p.trained_to for p in processes])
    return retrained, beyond, sum(1 for b in range(reached) if not times[b])


def test_a_restart_within_one_period_retrains_what_it_went_back_over_and_skips_nothing() -> None:
    # Killed after batch 99 (trained_to 100); the position said 96: 4 batches again, within H = 6.
    c = count_batches([ProcessBatches(0, 100), ProcessBatches(96, 180)], period=6, data_position=170)
    assert (c.trained, c.retrained, c.retrained_beyond_period, c.skipped) == (184, 4, 0, 0)
    # A position 10 back: 4 beyond one period. One ahead of the training: 3 batches skipped.
    assert count_batches([ProcessBatches(0, 100), ProcessBatches(90, 120)], period=6).retrained_beyond_period == 4
    assert count_batches([ProcessBatches(0, 100), ProcessBatches(103, 120)], period=6).skipped == 3
    # The synchronizer's last position beyond every batch trained: the stream moved past batches nobody trained.
    assert count_batches([ProcessBatches(0, 100)], period=6, data_position=104).skipped == 4
    # Killed again before it got back to where it was: those batches are trained a third time.
    c = count_batches([ProcessBatches(0, 50), ProcessBatches(45, 48), ProcessBatches(45, 60)], period=6)
    assert (c.retrained, c.skipped) == (3 + 5, 0)
    assert count_batches([], period=6) == count_batches([], period=6, data_position=0)


@pytest.mark.parametrize("seed", range(20))
def test_the_counts_match_counting_batch_by_batch(seed: int) -> None:
    rng = random.Random(seed)
    processes, furthest = [], 0
    for _ in range(rng.randrange(1, 12)):
        start = max(0, furthest + rng.randrange(-15, 4)) if processes else rng.choice([0, 0, 3])
        processes.append(ProcessBatches(start, start + rng.randrange(0, 40)))
        furthest = max(furthest, processes[-1].trained_to)
    position = rng.randrange(0, furthest + 5)
    c = count_batches(processes, period=6, data_position=position)
    assert (c.retrained, c.retrained_beyond_period, c.skipped) == by_hand(processes, 6, position)
    assert c.trained == sum(p.trained_to - p.resumed_at for p in processes)


def test_the_batch_log_keeps_every_process_and_ignores_a_line_cut_short(tmp_path: Path) -> None:
    path = tmp_path / "learner-0.log"
    first = BatchLog(path, 0)
    for batch in range(7):
        first.trained(batch)
    first.close()  # as a kill -9 would leave it: every line written is there
    BatchLog(path, 5).close()  # a process killed before its first step
    third = BatchLog(path, 5)
    third.trained(5)
    third.close()
    with path.open("a") as f:
        f.write("trained 6")  # cut short: no newline
    assert read_batch_log(path) == [ProcessBatches(0, 7), ProcessBatches(5, 5), ProcessBatches(5, 6)]
    assert read_batch_log(tmp_path / "none.log") == []
    BatchLog(None, 3).trained(3)  # off: writes nothing
    (tmp_path / "bad.log").write_text("resumed 0\nstepped 1\n")
    with pytest.raises(ValueError, match="not a batch log line"):
        read_batch_log(tmp_path / "bad.log")


def test_chaos_json_counts_each_learner_and_a_skipped_batch_is_a_violation() -> None:
    config = build_config(preset="tiny", overrides=("run.learners=2", "protocol.lease_s=3"))
    period = config.protocol.period
    outcome = ChaosOutcome(
        completed=True, failure="", records=[], samples=[], sync_restarts=[], eval_loss=2.0, wall_s=60.0,
        status_url="", final_status={"learners": [{"id": "learner-0", "data_position": 140},
                                                  {"id": "learner-1", "data_position": 200}]},
        batches={"learner-0": [ProcessBatches(0, 100), ProcessBatches(95, 150)],
                 "learner-1": [ProcessBatches(0, 60), ProcessBatches(50, 120), ProcessBatches(121, 190)]})
    report = build_report(outcome, config, window_s=10, seed=0, baseline=None)
    assert report["batch_period"] == period == 6
    assert report["batches_trained"] == 155 + 60 + 70 + 69
    assert report["batches_retrained"] == 5 + 10 and report["batches_retrained_beyond_period"] == 10 - period
    # learner-1: batch 120 never trained; its position 200 is beyond its furthest batch (189): 10 more.
    assert report["batches_skipped"] == 11
    assert report["batches_by_learner"]["learner-0"] == {
        "processes": [[0, 100], [95, 150]], "data_position": 140, "trained": 155, "retrained": 5,
        "retrained_beyond_period": 0, "skipped": 0}
    assert report["violations"][-1] == ("learner-1 skipped 11 batches of its data (never trained, although its "
                                        "stream moved past them)")
