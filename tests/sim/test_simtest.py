"""Swarm simulation testing: the real protocol passes, and planted bugs are found, with their seed."""

from __future__ import annotations

import dataclasses
import json

import pytest

from ddiloco import cli
from ddiloco.core.learner_side.learner_core import Learner
from ddiloco.core.sync_side.merge import MERGE_RULES, MergeRuleName
from ddiloco.core.sync_side.synchronizer import Synchronizer
from ddiloco.sim.swarm import DEFAULT_SEEDS, SeedResult, draw_world, run_simtest


def first_failure() -> SeedResult:
    """Run the default number of seeds in process until one fails (the planted bug is patched in)."""
    report = run_simtest(DEFAULT_SEEDS, stop_at_first=True)
    failing = report.violations + report.liveness_failures
    assert failing, f"simtest did not find the planted bug in {DEFAULT_SEEDS} seeds"
    return failing[0]


@pytest.mark.slow
def test_the_protocol_holds_its_invariants_and_catches_up_on_twenty_worlds():
    report = run_simtest(20)
    assert [r.violation for r in report.violations] == []
    assert [r.liveness for r in report.liveness_failures] == []
    faults = report.faults()
    assert all(faults[kind] > 0 for kind in ("loss", "duplicate", "reorder", "partition", "freeze")), faults


def test_each_seed_draws_its_own_world_and_the_same_seed_the_same_one():
    a, _ = draw_world(3)
    b, _ = draw_world(3)
    c, _ = draw_world(4)
    assert a == b and a != c
    fixed, _ = draw_world(4, overrides=("faults.loss=0.3",))
    assert fixed.faults.loss == 0.3


def test_every_registered_merge_rule_is_swarm_tested():
    drawn = {draw_world(seed)[0].protocol.merge for seed in range(60)}
    assert drawn == set(MergeRuleName) == set(MERGE_RULES), "a merge rule simtest never draws is never swarm-tested"


def test_a_planted_bug_accepting_duplicates_is_found(monkeypatch):
    import ddiloco.core.sync_side.synchronizer as sync_module

    original = sync_module.check_contribution
    monkeypatch.setattr(sync_module, "check_contribution", lambda c, limits, **kw: original(c, limits, **{**kw, "last_seq": -1}))
    found = first_failure()
    assert "accepted twice" in found.violation and f"seed {found.seed}" in found.violation


@pytest.mark.slow
def test_a_planted_bug_merging_stale_work_is_found(monkeypatch):
    from ddiloco.core.shared.staleness import StalenessBound
    from ddiloco.core.sync_side.rounds import GlobalFragment

    original = GlobalFragment.check
    # Every check but the staleness bound: a stale contribution passes as if it were current.
    monkeypatch.setattr(GlobalFragment, "check",
                        lambda self, c, uplink, bound, now: original(self, c, uplink, StalenessBound(2**62, 0.0), now))
    found = first_failure()
    assert "staleness bound" in found.violation and f"seed {found.seed}" in found.violation


def test_a_planted_quorum_off_by_one_is_found(monkeypatch):
    original = Synchronizer.effective_quorum
    monkeypatch.setattr(Synchronizer, "effective_quorum", lambda self: max(1, original(self) - 1))
    found = first_failure()
    assert "requires" in found.violation and f"seed {found.seed}" in found.violation


@pytest.mark.slow
def test_a_planted_bug_following_updates_of_another_incarnation_is_found(monkeypatch):
    original = Learner._apply

    def any_incarnation(self, update, values, now):
        if self.session is not None:
            update = dataclasses.replace(update, incarnation=self.session.incarnation)
        return original(self, update, values, now)

    monkeypatch.setattr(Learner, "_apply", any_incarnation)
    found = first_failure()
    # Caught as the invariant, or by the liveness phase: a learner that follows foreign updates
    # ends on versions the global model never had and never catches up.
    if found.violation is not None:
        assert "never produced" in found.violation or "differs from the global value" in found.violation
    else:
        assert "behind" in found.liveness or "joining" in found.liveness


def test_a_planted_bug_ignoring_gaps_is_found_by_the_liveness_phase(monkeypatch):
    original = Learner.on_update
    monkeypatch.setattr(Learner, "on_update", lambda self, update, now: (original(self, update, now), [])[1])
    found = first_failure()
    assert found.liveness and "virtual" in found.liveness  # a learner stuck rejoining, named with the time


def test_simtest_json_has_the_documented_keys(capsys):
    assert cli.main(["simtest", "--seeds", "3", "--workers", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"seeds", "violations", "faults", "liveness_failures"} <= set(out)
    assert out["seeds"] == 3 and out["violations"] == [] and out["liveness_failures"] == []
    assert set(out["faults"]) == {"loss", "duplicate", "reorder", "partition", "freeze", "learner_crash", "sync_crash",
                                 "join_flood", "stall"}


@pytest.mark.parametrize(("argv", "message"), [
    (["--seeds", "0"], "--seeds must be >= 1"),
    (["--seeds", "many"], "invalid int value"),
    (["--faults", "loss,meteor"], "unknown fault kind 'meteor'"),
    (["--set", "faults.loss=1.5"], "faults.loss is a probability"),
    (["--set", "faults.lightning=0.1"], "unknown key faults.lightning"),
    (["--workers", "0"], "--workers must be >= 1"),
])
def test_bad_simtest_input_is_one_line(argv, message, capsys):
    try:
        code = cli.main(["simtest", *argv])
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
