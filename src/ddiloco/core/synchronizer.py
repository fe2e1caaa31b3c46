"""The synchronizer as an I/O-free state machine.

Drivers feed it events with the current time — ``register``, ``heartbeat``,
``contribute``, ``tick`` — and carry out the actions it returns (broadcast an update,
record a closed round). It never reads a clock, sleeps or touches a socket;
``next_deadline()`` tells the driver when to call ``tick`` again (grace windows, leases).

Per fragment p it keeps the canonical global value Θ_p (fp32, the sum of the dequantized
updates it has sent), the outer-optimizer momentum, the downlink quantization residual,
the version V_p, and the contributions pending for round V_p + 1.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ddiloco.core.codecs import get_codec
from ddiloco.core.config import ProtocolConfig
from ddiloco.core.grace import GraceWindow, effective_quorum
from ddiloco.core.merge import merge_mean, merge_rda, token_weights
from ddiloco.core.messages import (
    Action,
    Broadcast,
    Contribution,
    FragmentUpdate,
    FragmentValue,
    GlobalState,
    LeaseExpired,
    MergedContribution,
    Rejected,
    RoundClosed,
)
from ddiloco.core.outer import NesterovSGD


@dataclass(slots=True)
class LearnerRecord:
    """What the synchronizer knows of one learner."""

    alive: bool = True
    lease_until_s: float = 0.0
    last_seen_s: float = 0.0
    step_time_s: float | None = None
    accepted: int = 0
    rejected: int = 0
    registrations: int = 0
    last_seq: dict[int, int] = field(default_factory=dict)


@dataclass(slots=True)
class _Pending:
    contribution: Contribution
    delta: torch.Tensor
    arrived_s: float


_PendingKey = tuple[str, int]
"""(learner id, registration number): a restarted learner's Δ is measured from a new anchor,
so it must not supersede what its previous incarnation sent to the same round."""


@dataclass(slots=True)
class _Fragment:
    value: torch.Tensor
    is_embedding: bool
    version: int = 0
    momentum: torch.Tensor | None = None
    residual: torch.Tensor | None = None
    pending: dict[_PendingKey, _Pending] = field(default_factory=dict)
    first_arrival_s: float | None = None
    grace_deadline_s: float | None = None
    quorum_reached_s: float | None = None


class Synchronizer:
    """Collects contributions per fragment, merges at quorum + grace, applies the outer step."""

    def __init__(
        self,
        config: ProtocolConfig,
        initial_values: Sequence[torch.Tensor],
        embedding_fragments: Sequence[int] = (),
    ) -> None:
        config.validate()
        self.config = config
        self._uplink = get_codec(config.codec, block_size=config.block_size)
        self._downlink = get_codec(config.downlink_codec, block_size=config.block_size)
        self._outer = NesterovSGD(lr=config.outer_lr, momentum=config.outer_momentum)
        self.grace = GraceWindow(
            overlap_steps=config.overlap, gamma=config.grace_gamma, max_s=config.grace_max_s
        )
        embeds = set(embedding_fragments)
        self._fragments = [
            _Fragment(value=v.detach().to(torch.float32).flatten().clone(), is_embedding=i in embeds)
            for i, v in enumerate(initial_values)
        ]
        self.learners: dict[str, LearnerRecord] = {}
        self.rejections: Counter[str] = Counter()
        self.rounds_closed: Counter[str] = Counter()

    # ---- queries -------------------------------------------------------------------------

    @property
    def num_fragments(self) -> int:
        return len(self._fragments)

    def versions(self) -> tuple[int, ...]:
        return tuple(f.version for f in self._fragments)

    def value(self, fragment: int) -> torch.Tensor:
        """The canonical global value of a fragment (do not modify)."""
        return self._fragments[fragment].value

    def alive(self) -> list[str]:
        return sorted(name for name, rec in self.learners.items() if rec.alive)

    def global_state(self) -> GlobalState:
        return GlobalState(
            tuple(FragmentValue(i, f.version, f.value.clone()) for i, f in enumerate(self._fragments))
        )

    def pending_tokens(self) -> int:
        return sum(p.contribution.tokens for f in self._fragments for p in f.pending.values())

    def effective_quorum(self) -> int:
        """The number of fresh contributions a round needs right now (K, or fewer live learners)."""
        return effective_quorum(self.config.quorum, len(self.alive()), strict=self.config.strict_quorum)

    def grace_length_s(self) -> float:
        """The grace window a round reaching its quorum now would get."""
        return self.grace.length_s(self._fastest_step_s())

    def next_deadline(self) -> float | None:
        """Earliest time at which ``tick`` has something to do, or None."""
        times = [f.grace_deadline_s for f in self._fragments if f.grace_deadline_s is not None]
        times += [r.lease_until_s for r in self.learners.values() if r.alive]
        return min(times) if times else None

    # ---- events --------------------------------------------------------------------------

    def register(self, learner_id: str, now: float) -> GlobalState:
        """(Re)admit a learner: it gets a fresh lease and the full current state."""
        if not learner_id:
            raise Rejected("malformed", "empty learner id")
        rec = self.learners.setdefault(learner_id, LearnerRecord())
        rec.alive = True
        rec.registrations += 1
        rec.last_seq.clear()  # a restarted learner numbers its contributions from 0 again
        self._renew(rec, now)
        return self.global_state()

    def heartbeat(self, learner_id: str, now: float) -> None:
        """Renew a lease. A learner whose lease expired must register again (it missed updates)."""
        self._renew(self._live_record(learner_id), now)

    def leave(self, learner_id: str, now: float) -> list[Action]:
        """A learner is done: stop waiting for it now rather than when its lease runs out."""
        self._live_record(learner_id).lease_until_s = now
        return self.tick(now)

    def contribute(self, c: Contribution, now: float) -> list[Action]:
        """Validate and queue a contribution; close the round if that completes it.

        Raises :class:`Rejected` (counted) for anything that must not touch global state.
        """
        try:
            delta = self._validate(c)
        except Rejected as err:
            self.rejections[err.reason] += 1
            if c.learner_id in self.learners:
                self.learners[c.learner_id].rejected += 1
            raise
        rec = self.learners[c.learner_id]
        rec.last_seq[c.fragment] = c.seq
        rec.accepted += 1
        rec.step_time_s = c.step_time_s
        self._renew(rec, now)
        frag = self._fragments[c.fragment]
        key = (c.learner_id, rec.registrations)
        previous = frag.pending.get(key)
        if previous is not None:
            # Same learner again before the round closed: no version came out in between, so
            # its new Δ is measured from the same anchor and already contains the older
            # progress. It supersedes the old one and inherits its token and step counts.
            c = _fold(previous.contribution, c)
        frag.pending[key] = _Pending(c, delta, now)
        if frag.first_arrival_s is None:
            frag.first_arrival_s = now
        return self._maybe_close(c.fragment, now)

    def tick(self, now: float) -> list[Action]:
        """Expire leases and grace windows that are due at ``now``."""
        actions: list[Action] = []
        for name in sorted(self.learners):
            rec = self.learners[name]
            if rec.alive and rec.lease_until_s <= now:
                rec.alive = False
                actions.append(LeaseExpired(name, now))
        for index, frag in enumerate(self._fragments):
            if frag.grace_deadline_s is not None and frag.grace_deadline_s <= now:
                actions += self._close(index, now, reason="grace")
            elif frag.pending and actions:
                actions += self._maybe_close(index, now)  # fewer live learners may complete it
        return actions

    def drain(self, now: float) -> list[Action]:
        """End of training: merge whatever is pending in every fragment, quorum or not."""
        actions: list[Action] = []
        for index, frag in enumerate(self._fragments):
            if frag.pending:
                actions += self._close(index, now, reason="drain")
        return actions

    def observe_sync_time(self, seconds: float) -> None:
        """Driver-measured time to merge and deliver a round (sizes the next grace windows)."""
        self.grace.observe_sync(seconds)

    # ---- internals -----------------------------------------------------------------------

    def _renew(self, rec: LearnerRecord, now: float) -> None:
        rec.last_seen_s = now
        rec.lease_until_s = now + self.config.lease_s

    def _live_record(self, learner_id: str) -> LearnerRecord:
        rec = self.learners.get(learner_id)
        if rec is None or not rec.alive:
            raise Rejected("unknown_learner", f"learner {learner_id!r} is not registered (or its lease expired)")
        return rec

    def _validate(self, c: Contribution) -> torch.Tensor:
        rec = self._live_record(c.learner_id)
        if not 0 <= c.fragment < len(self._fragments):
            raise Rejected("unknown_fragment", f"fragment {c.fragment} (have {len(self._fragments)})")
        frag = self._fragments[c.fragment]
        if c.codec != self._uplink.name:
            raise Rejected("bad_codec", f"codec {c.codec!r}, expected {self._uplink.name!r}")
        numel = frag.value.numel()
        expected = self._uplink.encoded_size(numel)
        if len(c.payload) != expected:
            raise Rejected("bad_size", f"{len(c.payload)} payload bytes, expected {expected} for {numel} values")
        if c.base_version > frag.version:
            raise Rejected("future_version", f"base version {c.base_version} > current {frag.version}")
        if frag.version - c.base_version > self.config.staleness_max:
            raise Rejected(
                "stale", f"base version {c.base_version} lags {frag.version} by more than {self.config.staleness_max}"
            )
        if c.seq <= rec.last_seq.get(c.fragment, -1):
            raise Rejected("duplicate", f"seq {c.seq} for fragment {c.fragment} already received")
        delta = self._uplink.decode(c.payload, numel)
        if not bool(torch.isfinite(delta).all()):
            raise Rejected("non_finite", f"NaN or Inf in fragment {c.fragment}")
        norm = float(delta.norm())
        bound = self.config.delta_norm_ratio_max * max(float(frag.value.norm()), 1.0)
        if norm > bound:
            raise Rejected("norm_bound", f"outer-gradient norm {norm:.3g} exceeds bound {bound:.3g}")
        return delta

    def _fastest_step_s(self) -> float:
        times = [r.step_time_s for r in self.learners.values() if r.alive and r.step_time_s is not None]
        return min(times) if times else 0.0

    def _maybe_close(self, index: int, now: float) -> list[Action]:
        frag = self._fragments[index]
        contributors = {learner for learner, _ in frag.pending}
        if self.config.strict_quorum:
            # Synchronous DiLoCo: wait for K contributions, whoever is alive, then merge at once.
            return self._close(index, now, reason="quorum") if len(contributors) >= self.config.quorum else []
        alive = set(self.alive())
        if alive <= contributors:
            return self._close(index, now, reason="all-live")
        # Only contributions measured from the current version count toward its quorum. A late
        # one (its round closed before it arrived) rides along with the next round but does
        # not open it: otherwise every straggler would trigger a round of its own, and the
        # outer optimizer would step twice per period on half the learners.
        fresh = {key: p for key, p in frag.pending.items() if p.contribution.base_version == frag.version}
        if len({learner for learner, _ in fresh}) < self.effective_quorum():
            return []
        if frag.grace_deadline_s is None:
            frag.quorum_reached_s = now
            self.grace.observe_quorum(now - min(p.arrived_s for p in fresh.values()))
            grace = self.grace_length_s()
            if grace <= 0.0:
                return self._close(index, now, reason="no-grace")
            frag.grace_deadline_s = now + grace
        return []

    def _close(self, index: int, now: float, *, reason: str) -> list[Action]:
        frag = self._fragments[index]
        entries = [frag.pending[name] for name in sorted(frag.pending)]
        contribs = [e.contribution for e in entries]
        weights = token_weights([c.tokens for c in contribs], [c.steps for c in contribs])
        deltas = [e.delta for e in entries]
        use_rda = self.config.merge == "rda" and not frag.is_embedding
        merged = merge_rda(deltas, weights) if use_rda else merge_mean(deltas, weights)
        if reason == "drain":
            # The last merge of a run has no future for Nesterov's look-ahead to pay off in:
            # a plain step keeps the final model from overshooting along the momentum.
            update = merged * -self.config.outer_lr
        else:
            update, frag.momentum = self._outer.update(merged, frag.momentum)
        if frag.residual is not None:
            update = update + frag.residual
        payload = self._downlink.encode(update)
        sent = self._downlink.decode(payload, update.numel())
        frag.residual = update - sent  # error feedback: what this update could not carry
        frag.value += sent
        frag.version += 1
        opened = frag.first_arrival_s if frag.first_arrival_s is not None else now
        grace_s = 0.0 if frag.grace_deadline_s is None or frag.quorum_reached_s is None else (
            frag.grace_deadline_s - frag.quorum_reached_s
        )
        record = RoundClosed(
            fragment=index,
            version=frag.version,
            merged=tuple(
                MergedContribution(
                    c.learner_id, c.seq, c.tokens, c.steps, c.compute_s, c.first_step, c.base_version
                )
                for c in contribs
            ),
            quorum_required=self.effective_quorum(),
            reason=reason,
            grace_s=grace_s,
            opened_at_s=opened,
            closed_at_s=now,
        )
        frag.pending.clear()
        frag.first_arrival_s = frag.grace_deadline_s = frag.quorum_reached_s = None
        self.rounds_closed[reason] += 1
        update_msg = FragmentUpdate(index, frag.version, self._downlink.name, payload)
        return [record, Broadcast(update_msg, tuple(self.alive()))]

    # ---- checkpointing -------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: values, optimizer state, residuals, versions, registry."""
        frags = []
        for f in self._fragments:
            frags.append(
                {
                    "value": f.value.clone(),
                    "version": f.version,
                    "momentum": None if f.momentum is None else f.momentum.clone(),
                    "residual": None if f.residual is None else f.residual.clone(),
                }
            )
        return {
            "fragments": frags,
            "learners": {name: {"accepted": r.accepted, "rejected": r.rejected} for name, r in self.learners.items()},
            "rejections": dict(self.rejections),
            "rounds_closed": dict(self.rounds_closed),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`. Learners must register again (leases are not restored)."""
        frags = state["fragments"]
        if len(frags) != len(self._fragments):
            raise ValueError(f"checkpoint has {len(frags)} fragments, expected {len(self._fragments)}")
        for f, saved in zip(self._fragments, frags):
            if saved["value"].numel() != f.value.numel():
                raise ValueError("checkpoint fragment size mismatch")
            f.value = saved["value"].to(torch.float32).clone()
            f.version = int(saved["version"])
            f.momentum = saved["momentum"]
            f.residual = saved["residual"]
            f.pending.clear()
            f.first_arrival_s = f.grace_deadline_s = f.quorum_reached_s = None
        self.learners = {
            name: LearnerRecord(alive=False, accepted=int(v["accepted"]), rejected=int(v["rejected"]))
            for name, v in state["learners"].items()
        }
        self.rejections = Counter(state["rejections"])
        self.rounds_closed = Counter(state["rounds_closed"])


def _fold(old: Contribution, new: Contribution) -> Contribution:
    """Merge the counters of a superseded contribution into its successor."""
    return Contribution(
        learner_id=new.learner_id,
        fragment=new.fragment,
        base_version=new.base_version,
        seq=new.seq,
        tokens=old.tokens + new.tokens,
        steps=old.steps + new.steps,
        compute_s=old.compute_s + new.compute_s,
        step_time_s=new.step_time_s,
        codec=new.codec,
        payload=new.payload,
        first_step=old.first_step,
    )
