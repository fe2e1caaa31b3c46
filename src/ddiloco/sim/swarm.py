"""Swarm simulation testing of the protocol (TigerBeetle's VOPR, FoundationDB's simulator).

Every seed draws its own world — learners, quorum, fragments, period, overlap, staleness
bound and reach, waiting, leases, speeds, latency, and which faults attack it at what rates (swarm
testing: each seed explores a different mix) — and runs it on the virtual cluster with the
synthetic workload (:mod:`ddiloco.sim.synthetic`) in two phases:

1. **safety**: for ``safety_s`` virtual seconds the adversary loses, duplicates and reorders
   messages, cuts learners off, freezes them past their lease, crashes learners and the
   synchronizer; the invariant checker runs after every event;
2. **liveness**: faults stop. Once the last fault has ended (``quiet``), within the bound
   ``B`` (:func:`ddiloco.core.shared.liveness.catch_up_bound_s`) every learner that is up must be
   training in the synchronizer's current incarnation, alive there, and hold every fragment at least at the version the synchronizer had at ``quiet``; and the
   run must then finish its budget (stop, flush, merge the last rounds).

A failing seed is reported with the command that replays it.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np
import torch

from ddiloco.core.learner_side.learner_phase import LearnerPhase
from ddiloco.core.shared.errors import ConfigError
from ddiloco.core.shared.liveness import catch_up_bound_s
from ddiloco.core.sync_side.merge import MERGE_RULES
from ddiloco.settings.config import Config, check_seed
from ddiloco.settings.config_sources import apply_override, apply_section
from ddiloco.settings.fault_kinds import SIMULATED, FaultKind, parse_kind
from ddiloco.sim.harness import Recorder
from ddiloco.sim.invariants import InvariantViolation
from ddiloco.sim.synthetic import SyntheticWorkload
from ddiloco.sim.virtual_cluster import VirtualCluster

DEFAULT_SEEDS = 200
MAX_EVENTS = 1_000_000
"""A seed that needs more events than this is stuck in a storm (a liveness failure); runs use ~10k."""


@dataclass(frozen=True, slots=True)
class SeedResult:
    seed: int
    faults: dict[str, int]
    violation: str | None = None
    liveness: str | None = None
    virtual_s: float = 0.0
    events: int = 0
    learners: int = 0


@dataclass(slots=True)
class SimtestReport:
    seeds: list[SeedResult] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def violations(self) -> list[SeedResult]:
        return [r for r in self.seeds if r.violation]

    @property
    def liveness_failures(self) -> list[SeedResult]:
        return [r for r in self.seeds if r.liveness]

    def faults(self) -> dict[str, int]:
        total: Counter[str] = Counter({str(k): 0 for k in SIMULATED})
        for r in self.seeds:
            total.update(r.faults)
        return dict(total)

    def seeds_with(self) -> dict[str, int]:
        return {str(k): sum(1 for r in self.seeds if r.faults.get(k)) for k in SIMULATED}


def draw_world(seed: int, overrides: Sequence[str] = (), kinds: Iterable[FaultKind] = SIMULATED) -> tuple[Config, float]:
    """The seed's world: (configuration, safety phase in virtual seconds). ``overrides`` win."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x5EED]))
    kinds = set(kinds)
    m = int(rng.integers(2, 6))
    fragments = int(rng.integers(1, 5))
    shards = min(fragments, int(rng.choice([1, 1, 2, 3])))
    period = int(rng.integers(2, 9))
    lease_s = float(rng.uniform(4.0, 12.0))

    def on(kind: FaultKind) -> bool:
        return kind in kinds and bool(rng.random() < 0.5)

    sections = {
        "run": {"mode": "decoupled", "learners": m, "seed": seed},
        "protocol": {
            "fragments": fragments, "shards": shards, "period": period, "quorum": int(rng.integers(1, m + 1)),
            "overlap": int(rng.integers(0, 4)), "staleness_max": int(rng.integers(1, 5)),
            "alpha": float(rng.choice([0.0, 0.5])), "merge": str(rng.choice(MERGE_RULES)),
            "lease_s": lease_s, "heartbeat_s": float(rng.uniform(0.5, 3.0)),
            "grace_max_s": float(rng.uniform(0.5, 5.0)), "max_wait_s": float(rng.choice([0.0, 0.0, 3.0])),
        },
        "cluster": {
            "step_time_s": 1.0, "jitter": float(rng.uniform(0.0, 0.3)), "slow_fraction": float(rng.choice([0.0, 0.5])),
            "latency_s": float(rng.uniform(0.005, 0.2)), "rpc_timeout_s": float(rng.uniform(2.0, 5.0)),
            "checkpoint_every_rounds": int(rng.integers(1, 30)), "checkpoint_every_s": float(rng.uniform(5.0, 60.0)),
        },
        "faults": {
            "loss": float(rng.uniform(0.01, 0.25)) if on(FaultKind.LOSS) else 0.0,
            "duplicate": float(rng.uniform(0.01, 0.25)) if on(FaultKind.DUPLICATE) else 0.0,
            "reorder": float(rng.uniform(0.05, 0.4)) if on(FaultKind.REORDER) else 0.0,
            "reorder_delay_s": float(rng.uniform(0.5, 8.0)),
            "partition": float(rng.uniform(0.003, 0.02)) if on(FaultKind.PARTITION) else 0.0,
            "partition_s": float(rng.uniform(2.0, 20.0)),
            "freeze": float(rng.uniform(0.003, 0.015)) if on(FaultKind.FREEZE) else 0.0,
            "freeze_s": lease_s * float(rng.uniform(1.2, 3.0)),
            "mtbf_s": float(rng.uniform(40.0, 200.0)) if on(FaultKind.LEARNER_CRASH) else 0.0,
            "downtime_s": float(rng.uniform(5.0, 30.0)),
            "sync_crash": float(rng.uniform(0.003, 0.012)) if on(FaultKind.SYNC_CRASH) else 0.0,
            "sync_downtime_s": float(rng.uniform(0.5, 20.0)),
        },
    }
    safety_s = float(rng.uniform(120.0, 200.0))
    # Drawn last, so every earlier draw of a seed is what it was before this key existed.
    sections["protocol"]["staleness_reach"] = float(rng.choice([1.0, 4.0]))
    sections["protocol"]["staleness_leases"] = float(rng.choice([0.0, 1.0, 4.0]))
    sections["faults"]["join_flood"] = float(rng.uniform(0.003, 0.012)) if on(FaultKind.JOIN_FLOOD) else 0.0
    sections["faults"]["join_flood_s"] = float(rng.uniform(5.0, 40.0))
    sections["faults"]["join_flood_per_s"] = float(rng.uniform(2.0, 30.0))
    sections["faults"]["stall"] = float(rng.uniform(0.003, 0.015)) if on(FaultKind.STALL) else 0.0
    sections["faults"]["stall_s"] = float(rng.uniform(5.0, 60.0))
    config = Config()
    for section, values in sections.items():
        config = apply_section(config, section, values, origin=f"simtest seed {seed}")
    for assignment in overrides:
        config = apply_override(config, assignment)
    f = config.faults
    longest_fault_s = 1.5 * max(f.partition_s, f.freeze_s, f.downtime_s, f.sync_downtime_s,
                                f.join_flood_s if f.join_flood else 0.0, f.stall_s if f.stall else 0.0)
    time_s = safety_s + longest_fault_s + 2 * liveness_bound_s(config) + 30.0
    config = apply_section(config, "run", {"time_s": time_s, "tokens": 0}, origin="simtest")
    return config.validate(), safety_s


def liveness_bound_s(config: Config) -> float:
    """B of this world: :func:`~ddiloco.core.shared.liveness.catch_up_bound_s` with the virtual cluster's
    call deadline and its slowest learner's step."""
    c = config.cluster
    slowest_step_s = c.step_time_s * (c.slow_factor if c.slow_fraction else 1.0)
    return catch_up_bound_s(config.protocol, rpc_timeout_s=c.rpc_timeout_s, slowest_step_s=slowest_step_s)


def run_seed(seed: int, overrides: Sequence[str] = (), kinds: Iterable[FaultKind] = SIMULATED) -> SeedResult:
    """Both phases of one seed; a violation or a liveness failure ends it early."""
    torch.set_num_threads(1)
    config, safety_s = draw_world(seed, overrides, kinds)
    workload = SyntheticWorkload(config)
    cluster = VirtualCluster(workload, Recorder(config, workload), attack_until_s=safety_s)  # type: ignore[arg-type]
    quiet_s = max([safety_s] + [w.end_s for w in cluster.windows]
                  + [o.up_s for o in cluster.recorder.trace.all() if o.down_s < safety_s])
    check_s = quiet_s + liveness_bound_s(config)
    target: tuple[int, ...] | None = None
    events, verdict = 0, None
    try:
        cluster.start()
        while cluster.running():
            upcoming = cluster.queue.next_time()
            if target is None and upcoming > quiet_s:
                target = tuple(cluster.versions())
            if target is not None and upcoming > check_s and verdict is None:
                verdict = _caught_up(cluster, target) or ""
                if verdict:
                    break
            cluster.step_event()
            events += 1
            if events > MAX_EVENTS:
                verdict = f"event storm: {events:,} events by virtual {cluster.queue.now:.1f}s"
                break
        if not verdict and not cluster.finished:
            verdict = f"the run did not finish its budget (stopped at virtual {cluster.queue.now:.1f}s)"
        if not verdict and cluster.checker:
            for sync in cluster.syncs:
                cluster.checker.at_end(sync.incarnation, sync.core.pending_tokens())
    except InvariantViolation as err:
        return _result(seed, cluster, events, violation=str(err))
    except Exception as err:  # noqa: BLE001 - any crash of the protocol code is a finding
        return _result(seed, cluster, events, violation=f"{type(err).__name__}: {err}")
    return _result(seed, cluster, events, liveness=verdict or None)


def _caught_up(cluster: VirtualCluster, target: tuple[int, ...]) -> str | None:
    """Why the liveness property does not hold now, or None."""
    for node in cluster.learners:
        core = node.core
        if not node.up or core.phase in (LearnerPhase.STOPPING, LearnerPhase.STOPPED):
            continue
        where = f"{node.name} at virtual {cluster.queue.now:.1f}s"
        if core.phase is not LearnerPhase.TRAINING or node.failure is not None:
            return f"{where} is {core.phase} ({node.failure.detail if node.failure else 'no failure'})"
        for shard, (link, sync) in enumerate(zip(core.links, cluster.syncs)):
            if link.joining:
                return f"{where} is still joining shard {shard}"
            if link.session is None or link.session.incarnation != sync.incarnation:
                return f"{where} follows another incarnation of synchronizer shard {shard}"
            if node.name not in sync.core.alive():
                return f"{where} trains but holds no lease at synchronizer shard {shard}"
        behind = [p for p, (held, want) in enumerate(zip(core.versions, target)) if held < want]
        if behind:
            return f"{where} holds versions {core.versions}, behind {list(target)} on fragments {behind}"
    return None


def _result(seed: int, cluster: VirtualCluster, events: int, **verdict: str | None) -> SeedResult:
    faults = {str(k): int(v) for k, v in cluster.injected.items()}
    return SeedResult(seed, faults, virtual_s=cluster.queue.now, events=events, learners=len(cluster.learners),
                      **verdict)


def run_simtest(seeds: int = DEFAULT_SEEDS, *, first_seed: int = 0, workers: int = 1, overrides: Sequence[str] = (),
                kinds: Iterable[str] = SIMULATED, stop_at_first: bool = False,
                progress: Callable[[SeedResult], None] | None = None) -> SimtestReport:
    """Run ``seeds`` seeds from ``first_seed``; several worker processes when ``workers`` > 1."""
    if seeds < 1:
        raise ConfigError(f"--seeds must be >= 1, got {seeds}")
    check_seed(first_seed, "--first-seed")
    check_seed(first_seed + seeds - 1, "--first-seed + --seeds - 1 (the last seed)")
    kinds = tuple(parse_kind(k, SIMULATED, "ddiloco simtest") for k in kinds)
    draw_world(first_seed, overrides, kinds)  # a bad override fails here, once, with its message
    report = SimtestReport()
    started = time.perf_counter()
    jobs = [(s, tuple(overrides), kinds) for s in range(first_seed, first_seed + seeds)]
    if workers <= 1:
        results: Iterable[SeedResult] = (run_seed(*job) for job in jobs)
        for result in results:
            report.seeds.append(result)
            if progress:
                progress(result)
            if stop_at_first and (result.violation or result.liveness):
                break
    else:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            for result in pool.imap(_run_job, jobs):
                report.seeds.append(result)
                if progress:
                    progress(result)
    report.wall_s = time.perf_counter() - started
    return report


def _run_job(job: tuple[int, tuple[str, ...], tuple[FaultKind, ...]]) -> SeedResult:
    return run_seed(*job)


def replay_command(seed: int, overrides: Sequence[str] = (), kinds: Sequence[FaultKind] = SIMULATED) -> str:
    parts = ["ddiloco simtest", "--seeds 1", f"--first-seed {seed}"]
    parts += [f"--set {o}" for o in overrides]
    if set(kinds) != set(SIMULATED):
        parts.append(f"--faults {','.join(kinds)}")
    return " ".join(parts)


def default_workers() -> int:
    return max(1, min(os.cpu_count() or 1, 8))

