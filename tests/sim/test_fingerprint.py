"""The behaviour fingerprint (issue 54): the same tree gives the same string, a rule change moves it,
and the world it moved is named."""

from __future__ import annotations

import pytest

from ddiloco.core.sync_side import sync_queries
from ddiloco.core.sync_side.registry import Registry
from ddiloco.sim.behaviour_fingerprint import SCENARIOS, decisions, digest

BY_NAME = {s.name: s for s in SCENARIOS}


def test_a_world_decides_the_same_twice_and_its_decisions_are_plain_data():
    first = decisions(BY_NAME["join_flood"])
    assert digest(first) == digest(decisions(BY_NAME["join_flood"]))
    assert first["rounds"] and first["rejections"]["registry_full"] > 0 and first["faults"]["join_flood"] > 0


@pytest.mark.slow
def test_a_rule_change_moves_the_worlds_it_touches(monkeypatch):
    flood = digest(decisions(BY_NAME["join_flood"]))
    failures = digest(decisions(BY_NAME["failures_and_a_slow_learner"]))
    monkeypatch.setattr(Registry, "counted", Registry.alive)  # the flood's registrations counted again
    assert digest(decisions(BY_NAME["join_flood"])) != flood
    monkeypatch.undo()
    monkeypatch.setattr(sync_queries, "effective_quorum", lambda quorum, alive, strict: max(1, alive))  # K = M
    assert digest(decisions(BY_NAME["failures_and_a_slow_learner"])) != failures
