"""Issue 58's admission in the simulator: the adversary's *stall* (``faults.stall``) lets a learner's
uploads start and never finish, so the synchronizer's admission of uploads
(``core/sync_side/upload_admission.py``) holds their places, cuts them at their deadline
(``timed_out``) and refuses another of the same fragment meanwhile (``busy``), as the real service
does. Neither refusal is about the contribution: its work must reach the model in a later one."""

from __future__ import annotations

import pytest
import torch

from ddiloco.core.shared.actions import RoundClosed
from ddiloco.settings.config_sources import build_config
from ddiloco.settings.fault_kinds import FaultKind
from ddiloco.sim.harness import Recorder
from ddiloco.sim.swarm import run_seed
from ddiloco.sim.synthetic import SyntheticWorkload
from ddiloco.sim.virtual_cluster import VirtualCluster

WORLD = ("run.tokens=0", "run.time_s=300", "run.learners=3", "run.seed=5", "faults.stall_s=40")


class _MergedTokens(VirtualCluster):
    """The virtual cluster, adding up the tokens every merged round carried (once per fragment)."""

    merged = 0

    def on_round(self, record: RoundClosed, value: torch.Tensor) -> None:
        self.merged += sum(m.tokens for m in record.merged)
        super().on_round(record, value)


def run(stall: float) -> tuple[dict, _MergedTokens]:
    torch.set_num_threads(1)
    config = build_config(preset="tiny", overrides=(*WORLD, f"faults.stall={stall}"))
    workload = SyntheticWorkload(config)
    cluster = _MergedTokens(workload, Recorder(config, workload))  # type: ignore[arg-type]
    return cluster.run(), cluster


def test_stalled_uploads_are_cut_and_refused_and_their_work_reaches_the_model_later():
    calm, calm_cluster = run(0.0)
    stalled, cluster = run(0.01)
    assert calm["rejections"] == {} and calm_cluster.merged == 3 * calm_cluster.tokens  # 3 fragments
    assert stalled["faults"][str(FaultKind.STALL)] >= 3
    assert stalled["rejections"]["timed_out"] >= 10 and stalled["rejections"]["busy"] >= 10
    # Folded into the next contribution, the refused work is merged: all but what the last stalls
    # held at the run's end (dropped, as before the fix, it was over a quarter of the run's work).
    assert cluster.tokens == calm_cluster.tokens
    assert cluster.merged >= 0.97 * 3 * cluster.tokens
    assert stalled["honest_refused_steps"] == 0


@pytest.mark.parametrize("seed", [2, 4])
def test_worlds_with_stalls_keep_every_invariant_and_catch_up(seed):
    result = run_seed(seed, overrides=["faults.stall=0.03"], kinds=[FaultKind.STALL])
    assert result.faults[str(FaultKind.STALL)] > 0
    assert result.violation is None and result.liveness is None
