"""Configuration of the protocol itself: what learners and the synchronizer agree on.

Both drivers (virtual cluster and gRPC runtime) build their cores from one
:class:`ProtocolConfig`, so an experiment in simulation and a real run mean the same thing.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

from ddiloco.core.shared.choices import CodecName, Fragmentation, MergeRuleName
from ddiloco.core.shared.errors import ConfigError

if TYPE_CHECKING:
    from ddiloco.core.shared.codecs import Codec


class Mode(enum.StrEnum):
    """What a run trains with; the two protocol modes share one core."""

    DECOUPLED = "decoupled"
    """Decoupled DiLoCo: quorum, grace window, nobody waits."""
    DILOCO = "diloco"
    """Synchronous (streaming) DiLoCo: every learner waits for every synchronization."""
    DP = "dp"
    """Data parallel, non-elastic (a baseline of the virtual cluster)."""
    DP_ELASTIC = "dp-elastic"
    """Data parallel that goes on at reduced capacity (a baseline of the virtual cluster)."""

    @property
    def uses_protocol(self) -> bool:
        return self in (Mode.DECOUPLED, Mode.DILOCO)


@dataclass(frozen=True, kw_only=True, slots=True)
class ProtocolConfig:
    """Decoupled DiLoCo knobs (docs/concepts.md); names follow the paper's symbols."""

    fragments: int = 4
    """P: number of parameter fragments; the token embedding gets one of its own."""
    shards: int = 1
    """Synchronizer shards: shard i owns the fragments p with p mod shards = i (at most P)."""
    period: int = 12
    """H: inner steps between two synchronizations of the same fragment."""
    overlap: int = 2
    """τ: inner steps a fragment may be in flight before learners would notice; bounds the grace window."""
    quorum: int = 1
    """K: minimum number of learners whose contributions a round needs before it may close."""
    strict_quorum: bool = False
    """Keep waiting for K learners even when fewer are alive (synchronous DiLoCo baseline)."""
    blocking: bool = False
    """Learners wait for the new global value of a fragment they sent (synchronous DiLoCo)."""
    max_wait_s: float = 0.0
    """A learner that reaches t + τ steps without the update of a fragment it sent at step t
    waits for it up to this many seconds, then trains on (the paper's behaviour); 0 never waits."""
    alpha: float = 0.5
    """α: on arrival θ ← α·θ + (1−α)·Θ; 0 adopts the global value, 0.5 keeps half the overlap progress."""
    fragmentation: Fragmentation = Fragmentation.BALANCED
    """How parameters are split into fragments: balanced, layerwise or strided."""
    codec: CodecName = CodecName.INT4
    """Uplink codec for outer gradients."""
    downlink_codec: CodecName = CodecName.INT4
    """Codec for the outer updates the synchronizer sends back (with error feedback)."""
    block_size: int = 128
    """Elements per quantization block (one float32 scale each)."""
    merge: MergeRuleName = MergeRuleName.RDA
    """Merge rule for non-embedding fragments (the embedding always uses mean); the rules are those of
    ``core/sync_side/merge.py``."""
    outer_lr: float = 0.4
    """Outer SGD learning rate. DiLoCo's 0.7 was tuned for H≈500 and synchronous rounds; with
    H = 12 and partial rounds 0.4 gave the lowest eval loss here (docs/results.md)."""
    outer_momentum: float = 0.9
    """Outer Nesterov momentum."""
    align_sends: bool = True
    """Learners keep their sends of a fragment in phase with its rounds: after applying an update,
    the next contribution of that fragment is due H steps after the round's first contribution
    arrived (``FragmentUpdate.round_age_s``), instead of on the learner's own fixed schedule,
    which drifts with jitter, slow hardware and restarts. Synchronous DiLoCo runs without it
    (``for_mode``)."""
    space_rounds: bool = True
    """A fragment's next round may not reach its quorum sooner than (H − τ)·ξ_step after the
    previous one closed (ξ_step: the fastest live learner's step time). Learners drift out of
    phase; without this, one that sends after a round closed — measured from the new version,
    so fresh — opens a round of its own, and each fragment is merged and broadcast 1.5–2.7
    times per period. Its contribution now waits for the next round instead."""
    grace_gamma: float = 0.5
    """γ < 1: share of the measured slack the grace window may use."""
    grace_max_s: float = 30.0
    """Upper bound on the grace window, seconds."""
    staleness_max: int = 4
    """Contributions whose base version lags the current one by at most this are merged at full
    weight; beyond it their weight falls as (staleness_max + 1) / (lag + 1) (``core/shared/staleness.py``)."""
    staleness_reach: float = 3.0
    """Contributions lagging more than this many times ``staleness_max`` versions are refused as
    stale unless the bound in time lets them in (``staleness_leases``; 1 = every one beyond
    ``staleness_max``, the rule before issue 42, with ``staleness_leases`` 0). A learner whose round
    trip spans 2x ``staleness_max`` rounds left the model no worse merged; at 4x and 8x merging made
    it worse and refusing did not: docs/design.md, "Decisions the paper leaves open", *One learner
    on a long link*."""
    staleness_leases: float = 1.0
    """A contribution beyond ``staleness_reach`` x ``staleness_max`` versions is still merged (at the
    same falling weight) while it is a delay, not a distance: its base version stopped being current
    less than this many leases ago, and this learner's work of the fragment has lagged beyond the
    reach for less than that (0 = the bound in versions alone). A link fault of seconds makes work
    tens of versions late on a fast run, and a delay shorter than a lease is one the protocol counts
    a live learner's; a learner late beyond the reach for longer is on a link too long for the
    period (``core/shared/staleness.py``; docs/chaos.md, "The CI version")."""
    lease_s: float = 10.0
    """A learner not heard from for this long is no longer waited for."""
    heartbeat_s: float = 2.0
    """Interval between a learner's heartbeats (never more than a third of the lease)."""
    delta_norm_ratio_max: float = 10.0
    """The norm bound: this multiple of the fragment's recent norms (the lower median of the last
    32 measured, those above the bound included at the bound, once per sequence number; before 8
    are known, of max(‖Θ_p‖ at the start, 1)). An outer gradient above it is let in scaled down to
    the lower median, its weight with it; one above this multiple of the bound is refused. Measured
    against what most learners sent, so no one member can raise its own bound, and a warm-up that
    grows every learner's norm past it is neither refused nor locked out (``core/sync_side/norm_bound.py``)."""
    max_weight_ratio: float = 4.0
    """In a merge, no learner's token weight counts for more than this multiple of the round's
    lower-median weight (0 = no cap): a member claiming far more work than the others cannot
    steer the round, while honest differences (slower hardware, a folded period) keep their weight."""
    min_step_s: float = 1e-5
    """The fastest inner step the synchronizer counts: a learner's claimed steps beyond one per this
    many seconds since its process registered count toward neither the budget nor its merge weight
    (its outer gradient is still merged: speed is never a refusal), and its sequence numbers beyond
    one send per period of such steps are refused as implausible (an honest learner sends a fragment
    once per round trip). Raise it near your fastest real step to bound what a member may claim."""
    max_tokens_per_step: int = 0
    """Most tokens one inner step of a learner may claim (its whole batch, all its ranks); 0 = what
    each learner declares when it joins (at most 2^24). Set it to bound a member's claims."""
    forget_after_s: float = 600.0
    """A learner dead (lease expired) this long is dropped from the registry and status
    (its counts are kept as totals); 0 = never by age."""
    min_link_bytes_per_s: float = 32_000.0
    """The slowest link a (re)join is allowed for: the lease of a joining learner waits for its
    global state for up to lease_s + state bytes / this rate (the state sends as fast as the link allows)."""

    @classmethod
    def unknown_keys(cls, keys: Iterable[str]) -> list[str]:
        """The names among ``keys`` that are no field of this version's ProtocolConfig (sorted): a
        configuration written by a newer ddiloco carries settings this one cannot honour."""
        return sorted(set(keys) - {f.name for f in fields(cls)})

    def validate(self) -> None:
        """Raise ConfigError naming the first invalid field."""
        _positive_int("protocol.fragments", self.fragments)
        _positive_int("protocol.period", self.period)
        _positive_int("protocol.quorum", self.quorum)
        _positive_int("protocol.block_size", self.block_size)
        _positive_int("protocol.shards", self.shards)
        if self.shards > self.fragments:
            raise ConfigError(f"protocol.shards ({self.shards}) exceeds protocol.fragments ({self.fragments}): "
                              "a shard would own no fragment")
        if self.overlap < 0:
            raise ConfigError(f"protocol.overlap must be >= 0, got {self.overlap}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ConfigError(f"protocol.alpha must be in [0, 1], got {self.alpha}")
        for key, value, names in (
            ("protocol.codec", self.codec, CodecName),
            ("protocol.downlink_codec", self.downlink_codec, CodecName),
            ("protocol.merge", self.merge, MergeRuleName),
            ("protocol.fragmentation", self.fragmentation, Fragmentation),
        ):
            one_of(key, value, names)
        if self.outer_lr <= 0:
            raise ConfigError(f"protocol.outer_lr must be > 0, got {self.outer_lr}")
        if not 0.0 <= self.outer_momentum < 1.0:
            raise ConfigError(f"protocol.outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if not 0.0 <= self.grace_gamma < 1.0:
            raise ConfigError(f"protocol.grace_gamma must be in [0, 1), got {self.grace_gamma}")
        for key, value in (
            ("protocol.grace_max_s", self.grace_max_s),
            ("protocol.lease_s", self.lease_s),
            ("protocol.heartbeat_s", self.heartbeat_s),
            ("protocol.delta_norm_ratio_max", self.delta_norm_ratio_max),
            ("protocol.min_step_s", self.min_step_s),
            ("protocol.min_link_bytes_per_s", self.min_link_bytes_per_s),
        ):
            if not value > 0:
                raise ConfigError(f"{key} must be > 0, got {value}")
        if not self.max_wait_s >= 0:
            raise ConfigError(f"protocol.max_wait_s must be >= 0, got {self.max_wait_s}")
        if self.staleness_max < 0:
            raise ConfigError(f"protocol.staleness_max must be >= 0, got {self.staleness_max}")
        if not self.staleness_reach >= 1.0:
            raise ConfigError(f"protocol.staleness_reach must be >= 1, got {self.staleness_reach}")
        if not self.staleness_leases >= 0.0:
            raise ConfigError(f"protocol.staleness_leases must be >= 0, got {self.staleness_leases}")
        for key, value in (("protocol.max_weight_ratio", self.max_weight_ratio),
                           ("protocol.forget_after_s", self.forget_after_s)):
            if not value >= 0:
                raise ConfigError(f"{key} must be >= 0, got {value}")
        if 0 < self.max_weight_ratio < 1:
            raise ConfigError(f"protocol.max_weight_ratio must be 0 (no cap) or >= 1, got {self.max_weight_ratio}")
        if not 0 <= self.max_tokens_per_step <= 2**24:
            raise ConfigError(f"protocol.max_tokens_per_step must be in [0, 2^24], got {self.max_tokens_per_step}")

    def shard_of(self, fragment: int) -> int:
        """The synchronizer shard that owns ``fragment``."""
        return fragment % self.shards

    @property
    def heartbeat_interval_s(self) -> float:
        """How often a learner renews its lease: three chances before it expires."""
        return min(self.heartbeat_s, self.lease_s / 3)

    def uplink(self) -> "Codec":
        """The codec of Δ on the way to the synchronizer (``codec``, ``block_size``)."""
        from ddiloco.core.shared.codecs import get_codec  # torch: not for the CLI's checks of a configuration

        return get_codec(self.codec, block_size=self.block_size)

    def downlink(self) -> "Codec":
        """The codec of the updates on the way back (``downlink_codec``, ``block_size``)."""
        from ddiloco.core.shared.codecs import get_codec

        return get_codec(self.downlink_codec, block_size=self.block_size)

    def for_mode(self, mode: Mode | str, learners: int) -> "ProtocolConfig":
        """The protocol a mode runs. Synchronous DiLoCo is the same core with everyone waiting:
        K = M strict, blocking learners that adopt the global value (α = 0) merged by a plain
        mean, as in DiLoCo. Its learners keep the plan's schedule (no ``align_sends``): blocking
        already keeps them in step, and a round that waited for a restarted learner is old, so
        aligning on its age would make the others send that fragment again at once, out of
        phase with the restarted one (measured: the global model stood still for 140 virtual
        seconds of 600)."""
        if Mode(mode) is Mode.DILOCO:
            return replace(self, quorum=learners, strict_quorum=True, blocking=True, alpha=0.0, merge=MergeRuleName.MEAN,
                           align_sends=False)
        return self

    def validate_for(self, learners: int) -> None:
        """Checks that depend on the number of learners M."""
        self.validate()
        if self.quorum > learners:
            raise ConfigError(f"protocol.quorum (K={self.quorum}) exceeds the number of learners (M={learners})")


def one_of(key: str, value: object, names: type[enum.StrEnum]) -> None:
    """ConfigError unless ``value`` names a member of ``names`` (a configuration built in code may hold strings)."""
    if value not in set(names):
        raise ConfigError(f"{key}: unknown value {value!r} (choose from {', '.join(n.value for n in names)})")


def _positive_int(key: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{key} must be an integer >= 1, got {value!r}")
