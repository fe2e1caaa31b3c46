"""One fragment on the synchronizer: its global value and the round collecting its next version.

Per fragment p the synchronizer keeps the canonical global value Θ_p (fp32, the sum of the
dequantized updates it has sent), the outer optimizer's momentum, the downlink
quantization residual, the version V_p, and the round that will produce V_p + 1.

With the int4 downlink (the default) the outer state is lean: momentum in bf16 and the
residual in int8 relative to its block's last scale (``core/shared/kernels.py``), so a fragment
holds 4 + 2 + 1 bytes per parameter, plus its pending payloads while a round is open (the
close sums them into a buffer that all fragments share). ``tests/core/test_lean_state.py`` bounds how far 200 rounds
of it drift from an fp32 outer state; other downlink codecs keep fp32 momentum and residual.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from ddiloco.core.shared.codecs import Codec, fused_int4
from ddiloco.core.shared.kernels import RESIDUAL_LEVELS, outer_step_int4
from ddiloco.core.shared.messages import Contribution, FragmentUpdate, MergedRef, Rejected, RejectReason, Session
from ddiloco.core.shared.staleness import StalenessBound, SupersededTimes
from ddiloco.core.sync_side.accumulate import RoundAccumulator
from ddiloco.core.sync_side.norm_bound import NormBound
from ddiloco.core.sync_side.outer import NesterovSGD


class RoundPhase(enum.StrEnum):
    IDLE = "idle"
    """Nothing pending."""
    COLLECTING = "collecting"
    """Contributions pending, quorum not reached (or only late ones)."""
    GRACE = "grace"
    """Quorum reached: stragglers are admitted until the window's deadline."""


class RoundMove(enum.Enum):
    """What a round does after an arrival or a change in who is alive (:meth:`Round.move`)."""

    WAIT = "wait"
    CLOSE = "close"
    """Every live learner's work in it is fresh: merge now."""
    QUORUM = "quorum"
    """The quorum of fresh work is in: a grace window for the others."""
    LATE_IN = "late-in"
    """Every live learner is in, some only with late work: a grace window for their fresh work."""


PendingKey = tuple[str, Session]
"""(learner id, session): a learner that registered again measures Δ from a new anchor, so
its new contribution must not supersede what its previous session sent to the same round."""


@dataclass(slots=True)
class Pending:
    contribution: Contribution
    arrived_s: float


@dataclass(slots=True)
class Round:
    """Contributions pending for the next version of one fragment, and where the round stands."""

    phase: RoundPhase = RoundPhase.IDLE
    pending: dict[PendingKey, Pending] = field(default_factory=dict)
    opened_at_s: float = 0.0
    """First arrival (valid unless IDLE)."""
    quorum_at_s: float = 0.0
    """When the quorum was reached (valid in GRACE)."""
    deadline_s: float = 0.0
    """When the grace window closes the round (valid in GRACE)."""
    quorum_required: int = 0
    alive_at_quorum: int = 0
    """The quorum the round met, and how many learners were alive then (valid in GRACE)."""

    def add(self, key: PendingKey, pending: Pending) -> None:
        """Queue a contribution (replacing what the same learner and session sent before)."""
        if self.phase is RoundPhase.IDLE:
            self.phase = RoundPhase.COLLECTING
            self.opened_at_s = pending.arrived_s
        self.pending[key] = pending

    def merged(self, c: Contribution, now: float) -> Pending:
        """What the round will hold for ``c``: itself, or — when the same learner and session sent to
        this round before — its new Δ with the older token and step counts. From the same anchor,
        the new Δ contains the older progress; from a newer one (late work replaced by fresh work in
        its grace window, :meth:`move`), it contains the part the learner kept when it moved to that
        anchor (α). Changes nothing (the caller adds it once every check has passed)."""
        previous = self.pending.get((c.learner_id, c.session))
        if previous is None:
            return Pending(c, now)
        old = previous.contribution
        try:
            return Pending(replace(c, tokens=old.tokens + c.tokens, steps=old.steps + c.steps,
                                   compute_s=old.compute_s + c.compute_s, first_step=old.first_step), now)
        except ValueError as err:  # the sums leave the message bounds
            raise Rejected(RejectReason.IMPLAUSIBLE, f"with the pending contribution it replaces: {err}") from None

    def open_grace(self, now: float, length_s: float, quorum: int, alive: int) -> None:
        self.phase = RoundPhase.GRACE
        self.quorum_at_s = now
        self.deadline_s = now + length_s
        self.quorum_required = quorum
        self.alive_at_quorum = alive

    def contributors(self) -> set[str]:
        return {learner for learner, _ in self.pending}

    def fresh_contributors(self, version: int) -> set[str]:
        """Learners whose pending contribution was measured from the current version."""
        return {learner for (learner, _), p in self.pending.items() if p.contribution.base_version == version}

    def move(self, alive: set[str], version: int, quorum: int) -> RoundMove:
        """Only work measured from ``version`` (fresh) counts toward the quorum. Late work (its round
        closed before it arrived) rides along with the next round but does not open it: otherwise
        every straggler would trigger a round of its own, and the outer optimizer would step twice
        per period on half the learners. Nor does late work close a round at once when the last
        live learner arrives: its learners get a grace window to send fresh work. Otherwise the
        phases that put a learner just behind each close (its update not applied when it sends)
        hold it one version late for good: after 10 synchronizer restarts, 61% of the merged work
        was late and eval loss 7-24% above the run without faults (docs/chaos.md)."""
        fresh = self.fresh_contributors(version)
        if alive <= fresh:
            return RoundMove.CLOSE
        if self.phase is RoundPhase.GRACE:
            return RoundMove.WAIT
        if len(fresh) >= quorum:
            return RoundMove.QUORUM
        return RoundMove.LATE_IN if alive <= self.contributors() else RoundMove.WAIT

    def grace_ended(self, alive: set[str], version: int) -> RoundMove:
        """The grace window ran out: QUORUM to close with the quorum of fresh work it was opened
        for, LATE_IN to close with every live learner's work, late work included (a learner that
        missed an update must see the next version to find the gap), else WAIT (a learner joined
        meanwhile: the round collects on)."""
        if len(self.fresh_contributors(version)) >= self.quorum_required:
            return RoundMove.QUORUM
        if alive <= self.contributors():
            return RoundMove.LATE_IN
        self.phase = RoundPhase.COLLECTING
        return RoundMove.WAIT

    def first_fresh_arrival_s(self, version: int) -> float | None:
        arrivals = [p.arrived_s for p in self.pending.values() if p.contribution.base_version == version]
        return min(arrivals) if arrivals else None

    @property
    def grace_s(self) -> float:
        return self.deadline_s - self.quorum_at_s if self.phase is RoundPhase.GRACE else 0.0

    @property
    def tokens(self) -> int:
        return sum(p.contribution.tokens for p in self.pending.values())

    def clear(self) -> None:
        self.pending.clear()
        self.phase = RoundPhase.IDLE
        self.opened_at_s = self.quorum_at_s = self.deadline_s = 0.0
        self.quorum_required = self.alive_at_quorum = 0


@dataclass(slots=True)
class GlobalFragment:
    """Θ_p with its version and outer-optimizer state, and the round that will move it."""

    value: torch.Tensor
    is_embedding: bool
    accumulator: RoundAccumulator
    """The pending round's contributions (payload, weight, norm), summed at its close."""
    version: int = 0
    momentum: torch.Tensor | None = None
    """Outer momentum: bf16 with the fused int4 downlink, fp32 otherwise (None before the first step)."""
    residual: torch.Tensor | None = None
    """Downlink error feedback: int8 in units of ``residual_scales`` / 254 with the fused int4
    downlink, fp32 otherwise (None before the first update)."""
    residual_scales: torch.Tensor | None = None
    """float32 per block: the scale of the block's last update (the fused path's residual unit)."""
    round: Round = field(default_factory=Round)
    ready_at_s: float = 0.0
    """The next round may not reach its quorum before this time (``protocol.space_rounds``)."""
    norm_bound: NormBound = field(default_factory=NormBound)
    """The largest ‖Δ‖ this fragment accepts, and the recent norms behind it."""
    superseded: SupersededTimes = field(default_factory=SupersededTimes)
    """When its recent versions stopped being current (the staleness bound in time)."""
    beyond_reach: dict[str, float] = field(default_factory=dict)
    """Learner -> since when its contributions of this fragment lag beyond the bound in versions,
    every one since then (:meth:`check_version`: the bound in time is for a delay, not a distance)."""

    def check(self, c: Contribution, uplink: Codec, bound: StalenessBound, now: float) -> None:
        """:class:`Rejected` unless ``c`` fits this fragment: codec, size, a version it can be measured
        from, not beyond the staleness ``bound`` (``core/shared/staleness.py``)."""
        if c.codec != uplink.name:
            raise Rejected(RejectReason.BAD_CODEC, f"codec {c.codec!r}, expected {uplink.name!r}")
        expected = uplink.encoded_size(self.value.numel())
        if len(c.payload) != expected:
            raise Rejected(RejectReason.BAD_SIZE, f"{len(c.payload)} payload bytes, expected {expected} for "
                                                  f"{self.value.numel()} values")
        self.check_version(c.base_version, bound, now, c.learner_id)

    def check_version(self, base_version: int, bound: StalenessBound, now: float, learner: str) -> None:
        """:class:`Rejected` unless Δ measured from ``base_version`` can be merged at ``now``: at most
        ``bound.versions`` behind, or within the bound in time, which is for a delay: the base
        superseded less than ``bound.seconds`` ago, and ``learner``'s contributions of this fragment
        beyond the bound in versions for less than that. A learner held by a fault is late for
        the fault's length and current again after it; one whose link is too long for the period
        lags beyond the reach for good, and its work, merged, left the model worse than without it
        (docs/design.md, *One learner on a long link*). A refused contribution counts in that
        time as an accepted one does."""
        if base_version > self.version:
            raise Rejected(RejectReason.FUTURE_VERSION, f"base version {base_version} > current {self.version}")
        lag = self.version - base_version
        if lag <= bound.versions:
            return
        age_s = self.superseded.age_s(base_version, now)
        late_for_s = now - self.beyond_reach.get(learner, now)
        if late_for_s >= bound.seconds or not bound.merges(lag, age_s):
            self.beyond_reach.setdefault(learner, now)
            raise Rejected(RejectReason.STALE, bound.why_not(base_version, self.version, age_s, late_for_s=late_for_s))

    def landed(self, learner: str, base_version: int, bound: StalenessBound, now: float) -> None:
        """``learner``'s contribution measured from ``base_version`` was accepted at ``now``: the time
        its contributions have lagged beyond the bound in versions goes on, starts, or ends."""
        if self.version - base_version > bound.versions:
            self.beyond_reach.setdefault(learner, now)
        else:
            self.beyond_reach.pop(learner, None)

    def close(self, outer: NesterovSGD, downlink: Codec, *, plain: bool) -> tuple[bytes, float]:
        """Merge the round, apply the outer step to Θ, return the compressed update and the
        round's coherence (:class:`~ddiloco.core.sync_side.accumulate.Accumulated`).

        ``plain``: a step of −lr·Δ without momentum — the last merge of a run has no later
        step for Nesterov's look-ahead to pay off in. With an int4 downlink this is one
        compiled pass over the fragment (``kernels.outer_step_int4``); otherwise the merged Δ
        goes through :meth:`step`.
        """
        acc, factor, coherence = self.accumulator.accumulated()
        if not fused_int4(downlink):
            merged = torch.from_numpy(acc * np.float32(factor))
            self.accumulator.clear()
            return self.step(merged, outer, downlink, plain=plain), coherence
        numel = self.value.numel()
        blocks = -(-numel // downlink.block_size)
        first = self.momentum is None
        if first and not plain:
            self.momentum = torch.empty(numel, dtype=torch.bfloat16)  # the kernel writes it whole
        if self.residual is None:
            self.residual = torch.zeros(numel, dtype=torch.int8)
            self.residual_scales = torch.zeros(blocks, dtype=torch.float32)
        assert self.residual_scales is not None
        momentum = _bits(self.momentum) if self.momentum is not None else np.empty(0, dtype=np.uint16)
        scales = np.empty(blocks, dtype=np.float32)
        packed = np.zeros((numel + 1) // 2, dtype=np.uint8)
        outer_step_int4(acc, factor, outer.lr, outer.momentum, first, plain, momentum, self.residual.numpy(),
                        self.residual_scales.numpy(), self.value.numpy(), downlink.block_size, scales, packed)
        self.accumulator.clear(zeroed=True)  # the kernel zeroed it as it read it
        self.version += 1
        return scales.astype("<f4", copy=False).tobytes() + packed.tobytes(), coherence

    def step(self, merged: torch.Tensor, outer: NesterovSGD, downlink: Codec, *, plain: bool) -> bytes:
        """The reference outer step: Θ ← Θ + decode(encode(update + residual)), error feedback kept."""
        if plain:
            update = merged * -outer.lr
        else:
            update, self.momentum = outer.update(merged, self.momentum)
        if self.residual is not None:
            update = update + self.residual
        payload = downlink.encode(update)
        sent = downlink.decode(payload, update.numel())
        self.residual = update - sent  # error feedback: what this update could not carry
        self.value += sent
        self.version += 1
        return payload

    def replay(self, payload: bytes, outer: NesterovSGD, downlink: Codec, *, plain: bool) -> None:
        """Redo a merged round from the update it sent (the round log, after a crash).

        Θ is the sum of the updates sent, so it comes back bit for bit. The momentum is
        recovered from the sent update u (Nesterov: m ← μ·m + Δ and u = −lr·(Δ + μ·m) give
        m ← (μ·m − u/lr) / (1 + μ)); what the update could not carry (the error-feedback
        residual) is not in the log and is taken as zero from here on, so the recovered
        momentum is off by at most the rounds' quantization errors over lr·(1 + μ), fading by
        μ per round (``tests/core/test_round_replay.py`` bounds it)."""
        numel = self.value.numel()
        sent = downlink.decode(payload, numel)
        if not plain:
            u = sent if self.residual is None else sent - self._residual_values(downlink)
            mu = outer.momentum
            previous = torch.zeros(numel) if self.momentum is None else self.momentum.to(torch.float32)
            momentum = previous.mul_(mu).sub_(u, alpha=1.0 / outer.lr).div_(1.0 + mu)
            lean = fused_int4(downlink)
            self.momentum = momentum.to(torch.bfloat16) if lean else momentum
        self.value += sent
        if self.residual is not None:
            self.residual.zero_()
        self.version += 1
        self.round.clear()
        self.accumulator.clear()
        self.superseded.clear()  # when it was superseded belongs to the crashed process's clock

    def _residual_values(self, downlink: Codec) -> torch.Tensor:
        """The residual as float32 values (the lean int8 form times its block's unit)."""
        assert self.residual is not None
        if not fused_int4(downlink):
            return self.residual
        assert self.residual_scales is not None
        units = (self.residual_scales / float(RESIDUAL_LEVELS)).repeat_interleave(downlink.block_size)[: self.residual.numel()]
        return self.residual.to(torch.float32) * units

    def state_dict(self) -> dict[str, Any]:
        """A copy of this fragment's state (one fragment's worth of memory, taken on the core's thread)."""
        return {
            "value": self.value.clone(),
            "version": self.version,
            "momentum": _copy(self.momentum),
            "residual": _copy(self.residual),
            "residual_scales": _copy(self.residual_scales),
            "norm_bound": self.norm_bound.state_dict(),
        }

    def load_state_dict(self, saved: dict[str, Any], *, lean: bool) -> None:
        """Restore from :meth:`state_dict` (``lean``: the fused int4 downlink's bf16/int8 outer state)."""
        numel = self.value.numel()
        value = saved["value"]
        if value.numel() != numel or value.dtype != torch.float32:
            raise ValueError(f"fragment value of {value.numel()} {value.dtype} values, expected {numel} float32")
        momentum, residual, scales = saved["momentum"], saved["residual"], saved.get("residual_scales")
        want = (torch.bfloat16, torch.int8) if lean else (torch.float32, torch.float32)
        for name, t, dtype in (("momentum", momentum, want[0]), ("residual", residual, want[1])):
            if t is not None and (t.numel() != numel or t.dtype != dtype):
                raise ValueError(f"fragment {name} of {t.numel()} {t.dtype} values, expected {numel} {dtype}")
        if lean and residual is not None and scales is None:
            raise ValueError("fragment residual without its block scales")
        self.value.copy_(value.reshape(-1))
        self.version = int(saved["version"])
        self.momentum = _restored(self.momentum, momentum)
        self.residual = _restored(self.residual, residual)
        self.residual_scales = None if scales is None or not lean else scales.to(torch.float32).reshape(-1).clone()
        self.norm_bound.load_state_dict(saved.get("norm_bound", saved))  # before NormBound: the same keys, flat
        self.round.clear()
        self.accumulator.clear()
        self.superseded.clear()

    def update_message(self, payload: bytes, codec: Codec, incarnation: int, index: int,
                       round_age_s: float, merged: tuple[MergedRef, ...]) -> FragmentUpdate:
        return FragmentUpdate(index, self.version, codec.name, payload, incarnation, round_age_s, merged)


def _bits(t: torch.Tensor) -> np.ndarray:
    """A bf16 tensor's storage as uint16 (what the kernels read and write)."""
    return t.view(torch.int16).numpy().view(np.uint16)


def _restored(held: torch.Tensor | None, saved: torch.Tensor | None) -> torch.Tensor | None:
    """``saved``'s values, copied into the tensor already held where it fits (no second copy
    alive while a restore runs); never ``saved`` itself, which its owner may restore again."""
    if saved is None:
        return None
    if held is not None and held.dtype == saved.dtype and held.numel() == saved.numel():
        return held.copy_(saved.reshape(-1))
    return saved.reshape(-1).clone()


def _copy(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.clone()
