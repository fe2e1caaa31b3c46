"""Invariants the virtual cluster checks after every event (docs/design.md, "The virtual cluster").

Safety properties of the protocol, whatever the adversary does:

- a round never merges below its quorum (except the final drain): K fresh contributions, or
  as many as there were live learners when the quorum was decided, computed here from K
  and the live count, independently of the synchronizer's own rule;
- within one synchronizer incarnation versions only increase, by one per round, starting
  from what its checkpoint and round log restored (never past it);
- a fragment's version never goes back across a synchronizer crash: a restarted incarnation
  starts at the newest version any earlier one merged, with the same value bit for bit;
- every merged contribution was measured from a version at most ``staleness_max`` behind, or
  from one that stopped being current at most ``staleness_s`` before it arrived (the time of
  each version's end taken from the round records, whichever incarnation merged them);
- no contribution is accepted (or merged) twice, and no two merged Δs of one session and
  fragment were measured from the same anchor (the second would carry the first's progress);
- the tokens an incarnation accepted are exactly the tokens it merged, plus what it still
  holds (or lost with it when it crashed);
- a learner's anchor is always, bit for bit, a value the synchronizer produced at that
  version in that incarnation;
- a learner only sends work of its current session, measured from the anchor it holds.

A violation raises :class:`InvariantViolation` naming the seed that reproduces it.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from typing import Sequence

import torch

from ddiloco.core.learner_side.learner_core import Learner
from ddiloco.core.shared.actions import CloseReason, RoundClosed
from ddiloco.core.shared.messages import Contribution


class InvariantViolation(AssertionError):
    pass


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha1(tensor.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


class InvariantChecker:
    def __init__(self, *, seed: int, staleness_max: int, quorum: int, strict_quorum: bool,
                 initial_values: Sequence[torch.Tensor], staleness_s: float = 0.0) -> None:
        self.seed = seed
        self.staleness_max = staleness_max
        self.staleness_s = staleness_s
        self._ended: dict[tuple[int, int], float] = {}
        """(fragment, version) -> when the round that replaced it closed."""
        self.quorum = quorum
        self.strict_quorum = strict_quorum
        self.tokens_accepted: Counter[int] = Counter()
        self.tokens_merged: Counter[int] = Counter()
        self.tokens_lost: Counter[int] = Counter()
        self._versions: dict[tuple[int, int], int] = {}
        self._values: dict[tuple[int, int, int], str] = {}
        self._initial = [_digest(v) for v in initial_values]
        self._newest: dict[int, tuple[int, str]] = {}
        """Per fragment, the newest version any incarnation merged and its value's digest."""
        self._accepted: set[tuple[int, str, int, int, int]] = set()
        self._merged: set[tuple[int, str, int, int, int]] = set()
        self._merged_from: dict[tuple[int, str, int, int], int] = {}
        """(incarnation, learner, session, fragment) -> the anchor version its last merged Δ was measured from."""
        self.checks = 0

    def _fail(self, message: str) -> None:
        raise InvariantViolation(f"{message} (reproduce with seed {self.seed})")

    def on_start(self, incarnation: int, fragments: Sequence[int], values: Sequence[torch.Tensor],
                 versions: Sequence[int], restored_versions: Sequence[int] | None) -> None:
        """A synchronizer (shard) incarnation starts: first start, or restart at ``restored_versions``
        (its checkpoint and round log)."""
        expected = list(restored_versions) if restored_versions is not None else [0] * len(versions)
        if list(versions) != expected:
            self._fail(f"incarnation {incarnation} starts at versions {list(versions)}, "
                       f"its checkpoint and log knew {expected}")
        for p, value, version in zip(fragments, values, versions):
            digest = _digest(value)
            newest, served = self._newest.get(p, (0, digest))
            if version < newest:
                self._fail(f"fragment {p} went back from version {newest} to {version} across a synchronizer crash")
            if version == newest and digest != served:
                self._fail(f"fragment {p} v{version} restored with another value than the one merged before the crash")
            self._newest[p] = (version, digest)
            self._versions[(incarnation, p)] = version
            self._values[(incarnation, p, version)] = digest

    def on_crash(self, incarnation: int, pending_tokens: int) -> None:
        self.tokens_lost[incarnation] += pending_tokens
        self._balance(incarnation, pending_tokens=0)

    def on_accepted(self, c: Contribution, incarnation: int) -> None:
        self.checks += 1
        key = (incarnation, c.learner_id, c.session.number, c.fragment, c.seq)
        if key in self._accepted:
            self._fail(f"contribution {key} accepted twice")
        self._accepted.add(key)
        self.tokens_accepted[incarnation] += c.tokens

    def on_round(self, record: RoundClosed, value: torch.Tensor) -> None:
        self.checks += 1
        inc, p = record.incarnation, record.fragment
        self._check_quorum(record)
        previous = self._versions.get((inc, p), 0)
        if record.version != previous + 1:
            self._fail(f"fragment {p}: version {record.version} after {previous} (incarnation {inc})")
        self._versions[(inc, p)] = record.version
        self._ended.setdefault((p, record.version - 1), record.closed_at_s)
        for m in record.merged:
            ended = self._ended.get((p, m.base_version))
            recent = ended is not None and m.arrived_s - ended < self.staleness_s
            if not (record.version - 1 - self.staleness_max <= m.base_version or recent) or \
                    m.base_version > record.version - 1:
                self._fail(f"fragment {p} v{record.version} merged {m.learner_id}'s work from version "
                           f"{m.base_version} (staleness bound {self.staleness_max} versions, "
                           f"{self.staleness_s:g} s)")
            key = (inc, m.learner_id, m.session, p, m.seq)
            if key in self._merged:
                self._fail(f"contribution {key} merged twice")
            self._merged.add(key)
            before = self._merged_from.get(key[:4], -1)
            if m.base_version <= before:
                self._fail(f"fragment {p} v{record.version} merged two Δs of {m.learner_id} measured from version "
                           f"{m.base_version}: the second carries the first's progress again")
            self._merged_from[key[:4]] = m.base_version
        self.tokens_merged[inc] += record.tokens
        self._values[(inc, p, record.version)] = digest = _digest(value)
        self._newest[p] = (record.version, digest)

    def _check_quorum(self, record: RoundClosed) -> None:
        contributors = {m.learner_id for m in record.merged}
        fresh = {m.learner_id for m in record.merged if m.base_version == record.version - 1}
        where = f"fragment {record.fragment} v{record.version} ({record.reason})"
        if record.reason is CloseReason.DRAIN:
            return
        if len(contributors) < record.quorum_required:
            self._fail(f"{where} merged {len(contributors)} < quorum {record.quorum_required}")
        if record.reason is CloseReason.QUORUM:
            needed, have = self.quorum, len(contributors)
        elif record.reason is CloseReason.ALL_LIVE:
            needed, have = record.alive, len(contributors)
        else:
            needed, have = max(1, min(self.quorum, record.alive)), len(fresh)
        if have < needed:
            self._fail(f"{where} merged {have} learners' work where quorum K={self.quorum} with {record.alive} "
                       f"alive requires {needed}")

    def on_anchor(self, learner: Learner, fragment: int) -> None:
        """After a learner adopts a state or applies an update: its anchor is a produced value."""
        self.checks += 1
        session = learner.session_of(fragment)
        assert session is not None
        version = learner.versions[fragment]
        expected = self._values.get((session.incarnation, fragment, version))
        if expected is None and version == 0:
            expected = self._initial[fragment]
        if expected is None:
            self._fail(f"{learner.learner_id} holds fragment {fragment} v{version}, which incarnation "
                       f"{session.incarnation} never produced")
        elif _digest(learner.anchor(fragment)) != expected:
            self._fail(f"{learner.learner_id}'s anchor for fragment {fragment} v{version} differs from the "
                       f"global value")

    def on_sent(self, learner: Learner, c: Contribution) -> None:
        self.checks += 1
        if c.session != learner.session_of(c.fragment):
            self._fail(f"{learner.learner_id} sent work of session {c.session} while holding "
                       f"{learner.session_of(c.fragment)}")
        if c.base_version != learner.versions[c.fragment]:
            self._fail(f"{learner.learner_id} sent Δ of fragment {c.fragment} from version {c.base_version} "
                       f"while holding version {learner.versions[c.fragment]}")

    def _balance(self, incarnation: int, pending_tokens: int) -> None:
        accepted = self.tokens_accepted[incarnation]
        accounted = self.tokens_merged[incarnation] + self.tokens_lost[incarnation] + pending_tokens
        if accepted != accounted:
            self._fail(f"incarnation {incarnation}: tokens accepted {accepted} != merged "
                       f"{self.tokens_merged[incarnation]} + lost {self.tokens_lost[incarnation]} + pending "
                       f"{pending_tokens}")

    def at_end(self, incarnation: int, pending_tokens: int) -> None:
        self._balance(incarnation, pending_tokens)
