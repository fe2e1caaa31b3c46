"""One list of fault kinds: each kind a tool offers, that tool injects; the others it refuses by name."""

from __future__ import annotations

import pytest

from ddiloco.chaos.schedule import Fault, load_schedule, seeded_schedule
from ddiloco.core.shared.errors import ConfigError
from ddiloco.settings.fault_kinds import REAL, SIMULATED, FaultKind, Injector
from ddiloco.sim.swarm import run_simtest


def test_every_kind_is_injected_somewhere_and_the_two_tools_share_the_crashes():
    assert set(SIMULATED) | set(REAL) == set(FaultKind)
    assert all(kind.injectors for kind in FaultKind)
    shared = set(SIMULATED) & set(REAL)
    assert {FaultKind.LEARNER_CRASH, FaultKind.FREEZE, FaultKind.SYNC_CRASH, FaultKind.PARTITION} <= shared
    assert all(kind.on_link == bool(kind.injectors & {Injector.VIRTUAL_LINK, Injector.REAL_LINK}) for kind in FaultKind)


@pytest.mark.parametrize("kind", SIMULATED, ids=str)
def test_each_kind_the_simulator_offers_is_injected_by_its_seeds(kind):
    report = run_simtest(8, kinds=(kind,), stop_at_first=True)
    assert report.violations == [] and report.liveness_failures == []
    faults = report.faults()
    assert faults[kind] > 0, faults
    assert all(count == 0 for other, count in faults.items() if other != kind), faults


def test_chaos_draws_every_kind_it_offers_and_nothing_else():
    faults = seeded_schedule(window_s=400, learners=3, lease_s=6.0, fragment_bytes=50_000, seed=0)
    assert {f.kind for f in faults} == set(REAL)
    assert all(isinstance(f, Fault) for f in faults)


@pytest.mark.parametrize("kind", [k for k in FaultKind if k not in REAL], ids=str)
def test_a_schedule_naming_a_kind_only_the_simulator_injects_is_refused_with_the_reason(kind, tmp_path):
    path = tmp_path / "s.toml"
    path.write_text(f'[[fault]]\ntime = 1\nfault = "{kind}"\ntarget = "learner-0"\nduration = 1\n')
    with pytest.raises(ConfigError, match=f"ddiloco chaos cannot inject {kind} faults, only the virtual cluster"):
        load_schedule(path)


def test_simtest_refuses_a_kind_only_chaos_injects():
    with pytest.raises(ConfigError, match="ddiloco simtest cannot inject latency faults, only ddiloco chaos"):
        run_simtest(1, kinds=("latency",))
