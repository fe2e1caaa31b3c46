"""A run's configuration, composed from one dataclass per component.

Layers, later ones winning: built-in defaults, the preset (``tiny``, ``small`` or
``default``), the main job's failures and slow learner (``ddiloco run`` on the virtual
cluster only, :data:`MAIN_JOB`), a TOML file, ``--set section.key=value`` overrides, then
the explicit CLI flags. The TOML file is a thin loader onto the dataclasses: sections and
keys are the field names, unknown ones are errors, and every mistake is one line naming
the key and the value.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from ddiloco.core.shared.deadlines import drain_after_stop_s
from ddiloco.core.shared.errors import ConfigError
from ddiloco.core.shared.protocol_config import Mode, ProtocolConfig, one_of
from ddiloco.settings.fault_kinds import SIMULATED, FaultKind
from ddiloco.settings.workload_settings import LrSchedule, ModelConfig, Precision

if TYPE_CHECKING:  # the run's limits are the core's (claims, messages: torch), built only for a run
    from ddiloco.core.sync_side.run_state import RunLimits

MODES = tuple(m.value for m in Mode)
MAX_SEED = 2**63 - 1
"""Seeds are non-negative 64-bit signed integers: what torch's and numpy's generators all take."""


def check_seed(seed: int, what: str) -> None:
    """A seed out of range stops with one line naming it (rather than a traceback from deep in numpy or torch)."""
    if not 0 <= seed <= MAX_SEED:
        raise ConfigError(f"{what} must be an integer from 0 to 2**63 - 1, got {seed}")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """Inner training of every learner (and of the data-parallel baselines)."""

    batch_size: int = 16
    """Sequences per inner step per learner (per replica for data parallel)."""
    lr: float = 3e-3
    """Inner AdamW learning rate (after warm-up)."""
    warmup_steps: int = 20
    """Linear learning-rate warm-up, in inner steps of each learner."""
    weight_decay: float = 0.1
    """Inner AdamW weight decay."""
    eval_batches: int = 8
    """Held-out batches per evaluation."""
    evals: int = 12
    """Evaluations of the global model spread over the run (plus one at the end)."""
    corpus: str = ""
    """Directory of the user's text files; empty means the built-in corpus (Python's stdlib sources)."""
    corpus_max_bytes: int = 8 * 2**20
    """Cap on corpus bytes read."""
    threads: int = 0
    """torch intra-op threads; 0 keeps torch's default. Small models run best on 1: a
    multi-threaded step slows down many times over when another process takes a core."""
    precision: Precision = Precision.FP32
    """Inner steps' arithmetic: fp32, or bf16 (autocast: matrix products in bfloat16; weights,
    gradients, AdamW state, Δ and merges stay fp32). Evaluation is always fp32."""
    schedule: LrSchedule = LrSchedule.CONSTANT
    """Inner learning rate after warm-up: constant, or cosine / linear decay to lr × lr_min_ratio
    over the run's budget. The position is the run's progress (all learners' tokens, or virtual
    time), not the learner's own: one that joins late or restarts warms up, then takes the rate
    the run has reached. Virtual cluster only (a learner process does not know the run's progress)."""
    lr_min_ratio: float = 0.1
    """Where a decaying schedule ends, as a share of lr."""

    def validate(self) -> None:
        one_of("train.precision", self.precision, Precision)
        one_of("train.schedule", self.schedule, LrSchedule)
        if not 0.0 <= self.lr_min_ratio <= 1.0:
            raise ConfigError(f"train.lr_min_ratio must be in [0, 1], got {self.lr_min_ratio}")
        for key in ("batch_size", "eval_batches", "evals", "corpus_max_bytes"):
            if getattr(self, key) < 1:
                raise ConfigError(f"train.{key} must be >= 1, got {getattr(self, key)}")
        if self.threads < 0:
            raise ConfigError(f"train.threads must be >= 0, got {self.threads}")
        if self.warmup_steps < 0:
            raise ConfigError(f"train.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not self.lr > 0:
            raise ConfigError(f"train.lr must be > 0, got {self.lr}")
        if self.weight_decay < 0:
            raise ConfigError(f"train.weight_decay must be >= 0, got {self.weight_decay}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterConfig:
    """The virtual cluster: hardware speed, jitter and network, in virtual seconds."""

    step_time_s: float = 1.0
    """Inner-step time of a learner on the reference hardware."""
    jitter: float = 0.05
    """Log-normal sigma of per-step time noise."""
    slow_fraction: float = 0.0
    """Share of learners on an older, slower hardware generation."""
    slow_factor: float = 1.18
    """Step-time multiplier of the slow generation (the paper's mixed-hardware case: ~18%)."""
    bandwidth_bps: float = 1e9
    """Link bandwidth between a learner and the synchronizer, bits per second."""
    latency_s: float = 0.01
    """One-way message latency."""
    rpc_timeout_s: float = 5.0
    """A call unanswered for this long (plus its transfer time) is reported undelivered (gRPC's deadline)."""
    checkpoint_every_rounds: int = 20
    """The synchronizer checkpoints after this many merged rounds (what a crash loses)..."""
    checkpoint_every_s: float = 30.0
    """... or this many virtual seconds after the previous checkpoint, whichever comes first."""
    late_learners: int = 0
    """The last N of the M learners join at ``late_join_s`` instead of at the start: capacity
    that frees up mid-run joins the job (the paper's scavenging). Decoupled mode only."""
    late_join_s: float = 0.0
    """When the late learners join: virtual seconds on the virtual cluster, wall seconds from
    the start with ``ddiloco run --runtime processes``."""

    def arrivals_s(self, learners: int) -> list[float]:
        """When each learner's process first starts: ``late_join_s`` for the last ``late_learners``, else 0."""
        return [self.late_join_s if m >= learners - self.late_learners else 0.0 for m in range(learners)]

    def validate(self) -> None:
        if self.checkpoint_every_rounds < 1:
            raise ConfigError(f"cluster.checkpoint_every_rounds must be >= 1, got {self.checkpoint_every_rounds}")
        for key in ("step_time_s", "slow_factor", "bandwidth_bps", "rpc_timeout_s", "checkpoint_every_s"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"cluster.{key} must be > 0, got {getattr(self, key)}")
        for key in ("jitter", "latency_s", "late_learners", "late_join_s"):
            if getattr(self, key) < 0:
                raise ConfigError(f"cluster.{key} must be >= 0, got {getattr(self, key)}")
        if not 0.0 <= self.slow_fraction <= 1.0:
            raise ConfigError(f"cluster.slow_fraction must be in [0, 1], got {self.slow_fraction}")


FAULT_RATES = tuple(str(k) for k in SIMULATED if k is not FaultKind.LEARNER_CRASH)
"""Fault options that are probabilities (in [0, 1]), one per kind the virtual cluster injects
(its learners' crashes come from ``faults.mtbf_s``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class FaultConfig:
    """Seeded failures, identical for every mode of a comparison (virtual seconds)."""

    mtbf_s: float = 0.0
    """Mean time between failures of each learner (exponential); 0 disables failures."""
    downtime_s: float = 60.0
    """Mean time a failed learner stays down (uniform in [0.5, 1.5] times this)."""
    restart_s: float = 20.0
    """Non-elastic data parallel: time to restart the whole job and load its checkpoint."""
    checkpoint_interval_s: float = 60.0
    """Non-elastic data parallel: interval between checkpoints (progress since is lost)."""
    reconfigure_s: float = 5.0
    """Elastic data parallel: pause to reconfigure when a replica leaves or returns."""
    # The adversary (Decoupled DiLoCo and synchronous DiLoCo on the virtual cluster; all off by
    # default). Probabilities per message, or per learner (synchronizer) and virtual second.
    loss: float = 0.0
    """Probability that a message is lost (a lost request or reply fails the call after its deadline)."""
    duplicate: float = 0.0
    """Probability that a message is delivered twice."""
    reorder: float = 0.0
    """Probability that a message is held back by a delay spike, so later ones overtake it."""
    reorder_delay_s: float = 2.0
    """Longest delay spike (uniform in [0, this])."""
    partition: float = 0.0
    """Per learner and virtual second: probability that its link to the synchronizer is cut."""
    partition_s: float = 15.0
    """Mean length of a partition (uniform in [0.5, 1.5] times this)."""
    freeze: float = 0.0
    """Per learner and virtual second: probability that it freezes (alive but silent, as under SIGSTOP)."""
    freeze_s: float = 15.0
    """Mean length of a freeze; longer than the lease, the learner comes back holding a stale state."""
    sync_crash: float = 0.0
    """Per virtual second: probability that the synchronizer crashes (it restarts from its last checkpoint)."""
    sync_downtime_s: float = 10.0
    """Mean time the synchronizer stays down after a crash."""
    join_flood: float = 0.0
    """Per virtual second: probability that a flood of abandoned joins starts (each synchronizer shard its own)."""
    join_flood_s: float = 20.0
    """Mean length of a flood."""
    join_flood_per_s: float = 20.0
    """Joins a second during a flood, each under a new id; every other one is abandoned once its state
    arrived (its lease runs, and it is never heard from), the others before."""
    stall: float = 0.0
    """Per learner and virtual second: probability that its uploads start to stall after their header."""
    stall_s: float = 30.0
    """Mean length of a stall (uniform in [0.5, 1.5] times this)."""

    def validate(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value < 0:
                raise ConfigError(f"faults.{f.name} must be >= 0, got {value}")
        for key in FAULT_RATES:
            if getattr(self, key) > 1:
                raise ConfigError(f"faults.{key} is a probability: it must be in [0, 1], got {getattr(self, key)}")
        if self.checkpoint_interval_s <= 0:
            raise ConfigError(f"faults.checkpoint_interval_s must be > 0, got {self.checkpoint_interval_s}")


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    """What to run and for how long."""

    mode: str = "decoupled"
    """decoupled, diloco (synchronous), dp (data parallel) or dp-elastic."""
    learners: int = 4
    """M: learners (replicas for data parallel)."""
    seed: int = 0
    """Seeds the model, the data order, step-time jitter and the failure trace."""
    tokens: int = 0
    """Budget: tokens processed by all learners together; 0 means the preset's."""
    time_s: float = 0.0
    """Budget in virtual seconds instead of tokens; 0 means use the token budget."""

    def validate(self) -> None:
        one_of("run.mode", self.mode, Mode)
        if self.learners < 1:
            raise ConfigError(f"run.learners must be >= 1, got {self.learners}")
        check_seed(self.seed, "run.seed")
        if self.tokens < 0:
            raise ConfigError(f"run.tokens must be >= 0, got {self.tokens}")
        if self.time_s < 0:
            raise ConfigError(f"run.time_s must be >= 0, got {self.time_s}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    """A whole run; sections mirror the TOML file."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    protocol: ProtocolConfig = field(default_factory=ProtocolConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    faults: FaultConfig = field(default_factory=FaultConfig)

    def validate(self) -> "Config":
        self.run.validate()
        self.model.validate()
        self.train.validate()
        self.protocol.validate_for(self.run.learners)
        self.cluster.validate()
        self.faults.validate()
        if self.run.tokens == 0 and self.run.time_s == 0:
            raise ConfigError("no budget: set run.tokens or run.time_s (or use a preset)")
        self._validate_late_learners()
        return self

    def _validate_late_learners(self) -> None:
        late = self.cluster.late_learners
        if not late:
            return
        if self.run.mode != Mode.DECOUPLED:
            raise ConfigError(f"cluster.late_learners={late} needs run.mode=decoupled: the other modes wait for "
                              "every learner from the start")
        if late >= self.run.learners:
            raise ConfigError(f"cluster.late_learners={late} must leave at least one of the "
                              f"run.learners={self.run.learners} learners training from the start")
        if self.protocol.quorum > self.run.learners - late:
            raise ConfigError(f"protocol.quorum={self.protocol.quorum} exceeds the {self.run.learners - late} learners "
                              f"there before cluster.late_join_s: no round could close until the late ones join")

    def run_limits(self, *, checkpoint_every_rounds: int, checkpoint_every_s: float,
                   drain_timeout_s: float | None = None) -> RunLimits:
        """When this run ends and how often its synchronizer checkpoints (every driver's, from one place)."""
        from ddiloco.core.sync_side.run_state import RunLimits

        protocol = self.protocol.for_mode(self.run.mode, self.run.learners)
        return RunLimits(
            tokens=0 if self.run.time_s else self.run.tokens,
            time_s=self.run.time_s,
            drain_timeout_s=drain_after_stop_s(protocol) if drain_timeout_s is None else drain_timeout_s,
            checkpoint_every_rounds=checkpoint_every_rounds,
            checkpoint_every_s=checkpoint_every_s,
            learners=self.run.learners,
        )

    def validate_for_processes(self) -> "Config":
        """What learner processes cannot do that the virtual cluster can."""
        if self.train.schedule != LrSchedule.CONSTANT:
            raise ConfigError(f"train.schedule={self.train.schedule!r} runs on the virtual cluster only: a learner "
                              "process does not know the run's progress (use train.schedule=constant)")
        injected = [f"faults.{k}={getattr(self.faults, k):g}" for k in ("mtbf_s", *FAULT_RATES) if getattr(self.faults, k)]
        if injected:
            raise ConfigError(f"{', '.join(injected)}: real processes take no simulated failure trace; inject kill -9, "
                              "SIGSTOP, cut links and synchronizer crashes into real processes with `ddiloco chaos` "
                              "(docs/chaos.md)")
        return self

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {f.name: dataclasses.asdict(getattr(self, f.name)) for f in fields(self)}
