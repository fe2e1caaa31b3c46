"""The replay log: recent updates per fragment under one byte budget for the whole synchronizer."""

from ddiloco.core.sync_side.replay import REPLAY_BYTES_MIN, REPLAY_UPDATES, ReplayLog, replay_budget


def test_the_budget_is_shared_by_every_fragment_and_the_oldest_update_goes_first():
    log: ReplayLog[str] = ReplayLog(3, budget_bytes=100)
    for version in (1, 2):
        for p in range(3):
            log.record(p, version, f"{p}v{version}", 20)
    assert log.held_bytes == 100  # the sixth update went over: fragment 0's v1, the oldest of all, was dropped
    assert list(log.since([0, 0, 0])) == [(0, "0v2"), (1, "1v1"), (1, "1v2"), (2, "2v1"), (2, "2v2")]
    log.record(1, 3, "1v3", 20)  # and now fragment 1's v1
    assert log.held_bytes == 100
    assert list(log.since([0, 0, 0])) == [(0, "0v2"), (1, "1v2"), (1, "1v3"), (2, "2v1"), (2, "2v2")]
    log.record(2, 3, "2v3", 60)
    assert log.held_bytes <= 100
    assert (2, "2v3") in list(log.since([0, 0, 0]))
    assert (0, "0v2") not in list(log.since([0, 0, 0]))  # the oldest went first again


def test_a_fragment_keeps_at_most_its_last_updates_and_a_learner_gets_only_newer_ones():
    log: ReplayLog[int] = ReplayLog(1, budget_bytes=10**9)
    for version in range(1, 20):
        log.record(0, version, version, 1)
    assert [u for _, u in log.since([0])] == list(range(20 - REPLAY_UPDATES, 20))
    assert [u for _, u in log.since([17])] == [18, 19]
    assert log.held_bytes == REPLAY_UPDATES


def test_the_budget_is_an_eighth_of_the_state_with_a_floor():
    assert replay_budget(1000) == REPLAY_BYTES_MIN
    assert replay_budget(4 * 10**9) == 5 * 10**8
