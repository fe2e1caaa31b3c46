"""Goodput and uptime of pre-training on N chips under chip failures (docs/goodput.md).

No single machine can run a million chips, so this module *models* them. Every chip is
interrupted as a Poisson process (mean time between interruptions ``mtbi_s``). A failed chip
takes its whole slice (``slice_chips``, the failure domain) out for a log-normal recovery time.
What a failure costs depends on the configuration:

- ``dp``: one lock-step job; every failure stops it for ``restart_s`` and rolls it back to the
  last in-memory checkpoint (``checkpoint_interval_s`` of progress at most).
- ``dp-elastic``: one lock-step job that drops the failed slice instead; every failure stalls it
  for ``reconfig_s`` and loses the step in flight; it then runs on the remaining slices.
- ``decoupled-M<n>``: n independent elastic learners of N/n chips; a failure stalls only the
  learner it hits. The global model advances while at least ``quorum`` learners run.

Failures that arrive while a stall is under way are handled by the same stall (the restart or
reconfiguration excludes every slice found dead). Within a lock-step group every step waits for
the slowest slice (``straggler_sigma``), so stragglers cost more in bigger groups.

Goodput = useful chip-time / provisioned chip-time; uptime = share of wall time in which the
global model makes progress it keeps. Both come from a seeded simulation, vectorized with numpy:
each group alternates exponential runs and fixed stalls (memoryless failures make that exact),
and slices that are down are subtracted from the chip-time of the runs they overlap.

The three recovery-cost constants (``reconfig_s``, ``restart_s``, ``recovery_mean_s``) are the
only ones fit to the paper, on its 1.2M-chip column alone (:mod:`ddiloco.scale.goodput_fit`);
docs/goodput.md lists every assumption and its source.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np

from ddiloco.core.shared.errors import ConfigError
from ddiloco.core.shared.protocol_config import Mode

SECONDS_PER_YEAR = 365.25 * 86_400.0
DEFAULT_CHIPS = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
DEFAULT_CONFIGS = ("dp", "dp-elastic", "decoupled-M2", "decoupled-M4", "decoupled-M8", "decoupled-M16")
CALIBRATION_CHIPS = 1_200_000
# Goodput at 1.2M chips, MTBI one year, as the paper publishes it (docs/goodput.md, "Calibration").
PUBLISHED_GOODPUT_1_2M = {
    "dp": 0.27, "dp-elastic": 0.58, "decoupled-M2": 0.70,
    "decoupled-M4": 0.82, "decoupled-M8": 0.88, "decoupled-M16": 0.93,
}
DEFAULT_SEEDS = 5
DEFAULT_HORIZON_S = 24 * 3600.0


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterModel:
    """Failure and recovery assumptions, shared by every configuration and cluster size."""

    mtbi_s: float = SECONDS_PER_YEAR
    """Mean time between interruptions of one chip (the paper's "aggressive" one year)."""
    slice_chips: int = 256
    """Failure domain: a chip failure takes this many chips out (one TPU v6e pod, assumed)."""
    recovery_mean_s: float = 2079.54
    """Mean time a failed slice stays out (repair or swap). Fit on the 1.2M column."""
    recovery_sigma: float = 1.0
    """Shape of the log-normal recovery time (assumed; heavy-ish tail)."""
    reconfig_s: float = 16.31
    """Stall of an elastic group per interruption (fit; DESIGN: "tens of seconds")."""
    restart_s: float = 52.34
    """Stop-and-restart cost of non-elastic data parallel per interruption (fit)."""
    checkpoint_interval_s: float = 10.0
    """Progress between in-memory checkpoints of non-elastic data parallel (assumed)."""
    step_s: float = 2.0
    """Inner step time; an interrupted elastic group loses the step in flight (assumed)."""
    straggler_sigma: float = 0.01
    """Per-slice, per-step relative jitter of step time; a lock-step step waits for the max."""
    overlap_steps: int = 5
    """tau: steps a learner trains on before it needs the merged fragment back."""
    quorum: int = 1
    """K: learners that must contribute before a round of the global model can close."""
    grace_s: float | None = None
    """Grace window; None = adaptive, grace_gamma * overlap slack (never makes learners wait)."""
    grace_gamma: float = 0.5

    def __post_init__(self) -> None:
        positive = {"mtbi_s": self.mtbi_s, "recovery_mean_s": self.recovery_mean_s, "step_s": self.step_s,
                    "checkpoint_interval_s": self.checkpoint_interval_s}
        for name, value in positive.items():
            if not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"{name} must be a positive number, got {value}")
        non_negative = {"recovery_sigma": self.recovery_sigma, "reconfig_s": self.reconfig_s,
                        "restart_s": self.restart_s, "straggler_sigma": self.straggler_sigma,
                        "grace_gamma": self.grace_gamma}
        if self.grace_s is not None:
            non_negative["grace_s"] = self.grace_s
        for name, value in non_negative.items():
            if not (value >= 0 and math.isfinite(value)):
                raise ConfigError(f"{name} must be >= 0, got {value}")
        if self.slice_chips < 1:
            raise ConfigError(f"slice_chips must be >= 1, got {self.slice_chips}")
        if self.overlap_steps < 0:
            raise ConfigError(f"overlap_steps must be >= 0, got {self.overlap_steps}")
        if self.quorum < 1:
            raise ConfigError(f"quorum must be >= 1, got {self.quorum}")

    @property
    def slack_s(self) -> float:
        """How long the global model may pause before a running learner notices."""
        return self.overlap_steps * self.step_s

    @property
    def effective_grace_s(self) -> float:
        return self.grace_gamma * self.slack_s if self.grace_s is None else self.grace_s


@dataclass(frozen=True, slots=True)
class ConfigSpec:
    """A configuration by name: ``dp``, ``dp-elastic`` or ``decoupled-M<n>``."""

    name: str
    kind: Mode
    """How it runs: data parallel, elastic data parallel, or Decoupled DiLoCo (``learners`` of them)."""
    learners: int


def parse_config(name: str) -> ConfigSpec:
    if name in (Mode.DP, Mode.DP_ELASTIC):
        return ConfigSpec(name, Mode(name), 1)
    match = re.fullmatch(r"decoupled-M([0-9]+)", name)
    if match is None or int(match.group(1)) < 1:
        raise ConfigError(f"unknown config {name!r}; expected dp, dp-elastic or decoupled-M<n> (n >= 1)")
    return ConfigSpec(name, Mode.DECOUPLED, int(match.group(1)))


@dataclass(frozen=True, slots=True)
class CellResult:
    goodput: float
    uptime: float


@dataclass(frozen=True, slots=True)
class Row:
    """Mean and spread over seeds of one (configuration, cluster size, failure rate)."""

    config: str
    chips: int
    mtbi_s: float
    goodput: float
    goodput_std: float
    uptime: float
    uptime_std: float
    seeds: int

    def to_json(self) -> dict[str, object]:
        row = asdict(self)
        row["mtbi_days"] = self.mtbi_s / 86_400.0
        return row


def check_cell(spec: ConfigSpec, chips: int, model: ClusterModel) -> None:
    """Reject cells that cannot exist, with the offending value in the message."""
    if chips < 1:
        raise ConfigError(f"chips must be >= 1, got {chips}")
    if spec.learners > chips:
        raise ConfigError(f"{spec.name} needs at least {spec.learners} chips, got {chips}")
    if spec.kind is Mode.DECOUPLED and model.quorum > spec.learners:
        raise ConfigError(f"quorum {model.quorum} is larger than the {spec.learners} learners of {spec.name}")


@lru_cache(maxsize=256)
def expected_max_normal(n: int) -> float:
    """E[max of n iid standard normals], by quadrature of 1 - Phi(x)^n."""
    if n <= 1:
        return 0.0
    x = np.linspace(0.0, 10.0, 4001)
    upper = 0.5 * (1.0 + np.array([math.erf(v / math.sqrt(2.0)) for v in x]))  # Phi(x), x >= 0
    lower = 1.0 - upper  # Phi(-x)
    return float(np.trapezoid(1.0 - upper**n, x) - np.trapezoid(lower**n, x))


def straggler_efficiency(slices: int, sigma: float) -> float:
    """Share of a lock-step group's chip-time that is not spent waiting for its slowest slice."""
    return 1.0 / (1.0 + sigma * expected_max_normal(max(1, slices)))


def _stream(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Standard exponentials whose [g, j] entry does not depend on ``cols``: drawn in column
    blocks, so a longer horizon extends a run without reshuffling it (common random numbers
    keep the calibration objective smooth)."""
    block = 64
    blocks = [rng.standard_exponential((rows, block)) for _ in range(-(-cols // block))]
    return np.hstack(blocks)[:, :cols]


def simulate_cell(spec: ConfigSpec, chips: int, model: ClusterModel, *, horizon_s: float = DEFAULT_HORIZON_S,
                  seed: int = 0) -> CellResult:
    """One seeded run of ``spec`` on ``chips`` chips for ``horizon_s`` seconds of wall time."""
    check_cell(spec, chips, model)
    if not horizon_s > 0:
        raise ConfigError(f"horizon must be positive, got {horizon_s} s")
    groups = spec.learners
    chips_per_group = chips / groups
    slice_chips = min(float(model.slice_chips), chips_per_group)
    slices_per_group = max(1, round(chips_per_group / slice_chips))
    # A chip in a slice that is already down cannot fail again: thin the rate by the
    # stationary share of live slices (a slice is up ~Exp, down for recovery_mean_s).
    slice_rate = slice_chips / model.mtbi_s
    rate = chips_per_group / model.mtbi_s / (1.0 + slice_rate * model.recovery_mean_s)
    stall_s = model.restart_s if spec.kind is Mode.DP else model.reconfig_s
    quantum_s = model.checkpoint_interval_s if spec.kind is Mode.DP else model.step_s
    warmup_s = 8.0 * model.recovery_mean_s  # slices already down at t = 0 are in steady state

    seq = np.random.SeedSequence([seed, chips, groups, 0 if spec.kind is Mode.DP else 1])
    runs_seed, absorb_seed, recovery_seed = seq.spawn(3)
    rng_absorb, rng_recovery = np.random.default_rng(absorb_seed), np.random.default_rng(recovery_seed)

    # Alternating renewal per group: run ~ Exp(rate), then a stall of stall_s.
    span = horizon_s + warmup_s
    cycles = span / (1.0 / rate + stall_s)
    cols = int(cycles * 1.2 + 6.0 * math.sqrt(cycles) + 16)
    while True:  # rarely more than once; a longer stream keeps the same prefix
        runs = _stream(np.random.default_rng(runs_seed), groups, cols) / rate
        fail = -warmup_s + np.cumsum(runs, axis=1) + stall_s * np.arange(cols)
        if fail[:, -1].min() >= horizon_s:
            break
        cols *= 2
    start = fail - runs

    # Work kept per run: whole quanta (checkpoints, or steps) before the failure.
    saved_end = np.where(fail <= horizon_s, start + np.floor(runs / quantum_s) * quantum_s, horizon_s)
    useful_s = np.clip(np.minimum(saved_end, horizon_s) - np.maximum(start, 0.0), 0.0, None).sum(axis=1)
    run_lo = np.clip(start, 0.0, horizon_s)
    run_hi = np.clip(fail, 0.0, horizon_s)
    running_s = (run_hi - run_lo).sum(axis=1)
    cum_running = np.concatenate([np.zeros((groups, 1)), np.cumsum(run_hi - run_lo, axis=1)], axis=1)

    # Every failure (the one starting a stall, and those absorbed by it) downs a slice.
    absorbed = rng_absorb.poisson(rate * stall_s, size=fail.shape)
    live_share = np.empty(groups)
    for g in range(groups):
        extra = np.repeat(fail[g], absorbed[g]) + stall_s * rng_absorb.random(int(absorbed[g].sum()))
        t_fail = np.concatenate([fail[g], extra])
        t_fail = t_fail[(t_fail >= -warmup_s) & (t_fail < horizon_s)]
        sigma = model.recovery_sigma
        mu = math.log(model.recovery_mean_s) - 0.5 * sigma * sigma
        recovery = np.exp(mu + sigma * rng_recovery.standard_normal(t_fail.size))

        def running_until(t: np.ndarray, g: int = g) -> np.ndarray:
            t = np.clip(t, 0.0, horizon_s)
            i = np.searchsorted(run_lo[g], t, side="right") - 1
            inside = np.clip(t - run_lo[g][np.maximum(i, 0)], 0.0, (run_hi[g] - run_lo[g])[np.maximum(i, 0)])
            return np.where(i >= 0, cum_running[g][np.maximum(i, 0)] + inside, 0.0)

        down_chip_s = slice_chips * (running_until(t_fail + recovery) - running_until(t_fail)).sum()
        live_share[g] = max(0.0, 1.0 - down_chip_s / (chips_per_group * running_s[g])) if running_s[g] > 0 else 0.0

    efficiency = straggler_efficiency(slices_per_group, model.straggler_sigma)
    useful_chip_s = chips_per_group * efficiency * useful_s * live_share
    if spec.kind is not Mode.DECOUPLED:
        return CellResult(float(useful_chip_s.sum() / (chips * horizon_s)), float(useful_s[0] / horizon_s))

    up_s, blocked_s = _quorum(fail, stall_s, horizon_s, groups, model)
    lost_chip_s = chips_per_group * efficiency * float(np.mean(live_share)) * blocked_s
    goodput = max(0.0, float(useful_chip_s.sum()) - lost_chip_s) / (chips * horizon_s)
    return CellResult(goodput, up_s / horizon_s)


def _quorum(fail: np.ndarray, stall_s: float, horizon_s: float, groups: int,
            model: ClusterModel) -> tuple[float, float]:
    """Decoupled learners: (seconds the global model advances, learner-seconds lost waiting).

    The global model advances while at least ``quorum`` learners run. A running learner does
    not notice a pause shorter than the overlap slack (tau steps); past it, its work can no
    longer be merged in time and is counted as lost (this is how K = M loses goodput). A grace
    window longer than the slack costs the running learners the excess at every stall.
    """
    lo = np.clip(fail, 0.0, horizon_s).ravel()
    hi = np.clip(fail + stall_s, 0.0, horizon_s).ravel()
    keep = hi > lo
    lo, hi = lo[keep], hi[keep]
    times = np.concatenate([lo, hi, [0.0, horizon_s]])
    delta = np.concatenate([np.ones(lo.size), -np.ones(hi.size), [0.0, 0.0]])
    order = np.argsort(times, kind="stable")
    times, stalled = times[order], np.cumsum(delta[order])
    seg_lo, seg_hi = times[:-1], times[1:]
    running = groups - stalled[:-1]
    down = running < model.quorum
    seg_len = seg_hi - seg_lo
    up_s = horizon_s - float(seg_len[down].sum())

    # Each maximal run of "down" segments is one pause of the global model.
    opens = down & ~np.concatenate([[False], down[:-1]])
    pause_start = np.maximum.accumulate(np.where(opens, seg_lo, -np.inf))
    noticed_from = pause_start + model.slack_s
    blocked = np.where(down, np.clip(seg_hi - np.maximum(seg_lo, noticed_from), 0.0, None), 0.0)
    blocked_s = float((running * blocked).sum())

    excess_s = max(0.0, min(model.effective_grace_s, stall_s) - model.slack_s)
    if excess_s > 0 and lo.size:
        at = np.clip(np.searchsorted(seg_lo, lo, side="right") - 1, 0, seg_lo.size - 1)
        blocked_s += float(np.where(down[at], 0.0, running[at]).sum()) * excess_s
    return up_s, blocked_s


def simulate_table(configs: Sequence[str], chips: Sequence[int], model: ClusterModel, *,
                   seeds: int = DEFAULT_SEEDS, seed: int = 0, horizon_s: float = DEFAULT_HORIZON_S) -> list[Row]:
    """Every (config, chips) cell, ``seeds`` seeded runs each, as mean and standard deviation."""
    if seeds < 1:
        raise ConfigError(f"seeds must be >= 1, got {seeds}")
    specs = [parse_config(c) for c in configs]
    for spec in specs:
        for n in chips:
            check_cell(spec, n, model)
    rows = []
    for spec in specs:
        for n in chips:
            cells = [simulate_cell(spec, n, model, horizon_s=horizon_s, seed=seed + k) for k in range(seeds)]
            g = np.array([c.goodput for c in cells])
            u = np.array([c.uptime for c in cells])
            rows.append(Row(spec.name, int(n), model.mtbi_s, float(g.mean()), float(g.std()),
                            float(u.mean()), float(u.std()), seeds))
    return rows


def smallest_learners(target: float, chips: int, model: ClusterModel, *, max_learners: int = 1024,
                      seeds: int = DEFAULT_SEEDS, seed: int = 0,
                      horizon_s: float = DEFAULT_HORIZON_S) -> tuple[int | None, float]:
    """The smallest power-of-two M whose mean goodput reaches ``target`` on ``chips`` chips.

    Returns (M, its goodput), or (None, best goodput seen) if no M up to ``max_learners``
    (nor one learner per slice) reaches it. Powers of two because that is how clusters are cut.
    """
    if not 0 < target <= 1:
        raise ConfigError(f"target goodput must be in (0, 1], got {target}")
    best = 0.0
    m = 1
    while m <= min(max_learners, chips):
        if m >= model.quorum:
            row = simulate_table([f"decoupled-M{m}"], [chips], model, seeds=seeds, seed=seed, horizon_s=horizon_s)[0]
            if row.goodput >= target:
                return m, row.goodput
            best = max(best, row.goodput)
        if chips / (2 * m) < model.slice_chips:
            break
        m *= 2
    return None, best
