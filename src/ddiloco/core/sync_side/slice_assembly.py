"""The slices of a sharded learner's contribution, held until all are in, then made one contribution.

A learner that is one FSDP2 job sends each fragment's Δ as W slices, one per rank
(``core/shared/slices.py``). The protocol counts a learner once — one claims check, one admission, one
token count, one merge weight — so the synchronizer admits nothing until the W slices of one
contribution (same learner, session, fragment and seq) are in, and then hands one whole
contribution to its ordinary path. A round never merges part of a learner's Δ.

Each slice is checked as it comes (codec, size, that it agrees with its siblings on every counter,
that its ranges overlap none of theirs); the set is checked whole when complete (the ranges tile
the fragment). One set per (learner, fragment) is held at a time: a slice of a newer seq or session
ends the older set. A set still incomplete when its fragment's round closes expires, and a sibling
that comes after is refused: both are ``slice_incomplete`` (the work of a rank that died).

With a byte-exact codec (fp32) the whole payload is the bytes the unsharded Δ would have been. A
quantizing codec encodes each slice on its own blocks; the whole is decoded slice by slice and
encoded once more (a second rounding, at most half a quantization step of the re-encoded block).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ddiloco.core.shared.codecs import Codec
from ddiloco.core.shared.messages import Contribution, Rejected, RejectReason, Session
from ddiloco.core.shared.slices import check_tiling

AGREED = ("world", "base_version", "tokens", "steps", "first_step", "codec")
"""What every slice of one contribution must say alike (``world`` is its slice's)."""


@dataclass(slots=True)
class _Set:
    session: Session
    seq: int
    parts: dict[int, Contribution]
    """The slices in, by rank."""

    def first(self) -> Contribution:
        return next(iter(self.parts.values()))


def _agreed(c: Contribution, name: str) -> object:
    assert c.slice is not None
    return c.slice.world if name == "world" else getattr(c, name)


class SliceAssembler:
    """The incomplete contributions of sharded learners, one per (learner, fragment)."""

    def __init__(self) -> None:
        self._sets: dict[tuple[str, int], _Set] = {}
        self._expired: dict[tuple[str, int], tuple[Session, int]] = {}
        """The newest set that expired per (learner, fragment): its late siblings are refused."""

    def __len__(self) -> int:
        return len(self._sets)

    def add(self, c: Contribution, numel: int, codec: Codec) -> tuple[Contribution | None, list[Contribution]]:
        """Take slice ``c`` of a fragment of ``numel`` values: the whole contribution when it was the
        last one missing (else None), and a slice of each set it ended (a newer seq or session), to be
        counted as ``slice_incomplete``. :class:`Rejected` (nothing changed) if it does not fit."""
        spec = c.slice
        assert spec is not None, "only slices are assembled"
        key = (c.learner_id, c.fragment)
        late = self._expired.get(key)
        if late is not None and late[0] == c.session and c.seq <= late[1]:
            raise Rejected(RejectReason.SLICE_INCOMPLETE, f"the other slices of seq {c.seq} expired with their round")
        if c.codec != codec.name:
            raise Rejected(RejectReason.BAD_CODEC, f"codec {c.codec!r}, expected {codec.name!r}")
        if spec.end > numel:
            raise Rejected(RejectReason.BAD_SIZE, f"rank {spec.rank}'s slice reaches index {spec.end} of a "
                                                  f"fragment of {numel} values")
        if len(c.payload) != codec.encoded_size(spec.numel):
            raise Rejected(RejectReason.BAD_SIZE, f"{len(c.payload)} payload bytes, expected "
                                                  f"{codec.encoded_size(spec.numel)} for a slice of {spec.numel}")
        ended: list[Contribution] = []
        held = self._sets.get(key)
        if held is not None and (held.session, held.seq) != (c.session, c.seq):
            if held.session == c.session and c.seq < held.seq:
                raise Rejected(RejectReason.SLICE_INCOMPLETE, f"seq {c.seq} came after the slices of seq {held.seq}")
            ended.append(self._end(key))
            held = None
        if held is not None:
            self._check_sibling(c, held)
            held.parts[spec.rank] = c
        else:
            held = self._sets[key] = _Set(c.session, c.seq, {spec.rank: c})
        if len(held.parts) < spec.world:
            return None, ended
        del self._sets[key]
        return self._assemble(list(held.parts.values()), numel, codec), ended

    def expire(self, fragment: int) -> list[Contribution]:
        """The round of ``fragment`` closed: its incomplete sets end (a slice of each, to count)."""
        return [self._end(key) for key in [k for k in self._sets if k[1] == fragment]]

    def forget(self, learner_ids: set[str]) -> None:
        """The registry forgot these learners: so does the assembler (their sets would expire anyway)."""
        for table in (self._sets, self._expired):
            for key in [k for k in table if k[0] in learner_ids]:
                del table[key]

    def _end(self, key: tuple[str, int]) -> Contribution:
        held = self._sets.pop(key)
        self._expired[key] = (held.session, held.seq)
        return held.first()

    @staticmethod
    def _check_sibling(c: Contribution, held: _Set) -> None:
        spec = c.slice
        assert spec is not None
        if spec.rank in held.parts:
            raise Rejected(RejectReason.DUPLICATE, f"rank {spec.rank}'s slice of seq {c.seq} came twice")
        other = held.first()
        for name in AGREED:
            if _agreed(c, name) != _agreed(other, name):
                assert other.slice is not None
                raise Rejected(RejectReason.SLICE_MISMATCH,
                               f"rank {spec.rank} says {name}={_agreed(c, name)}, rank {other.slice.rank} "
                               f"{_agreed(other, name)}")

    @staticmethod
    def _assemble(parts: list[Contribution], numel: int, codec: Codec) -> Contribution:
        specs = [p.slice for p in parts]
        problem = check_tiling(specs, numel)  # type: ignore[arg-type]
        if problem is not None:
            raise Rejected(RejectReason.SLICE_MISMATCH, f"the slices do not tile the fragment: {problem}")
        whole = torch.empty(numel, dtype=torch.float32)
        for part in sorted(parts, key=lambda p: p.slice.rank):  # type: ignore[union-attr]
            spec = part.slice
            assert spec is not None
            values = codec.decode(part.payload, spec.numel)
            if not bool(torch.isfinite(values).all()):
                raise Rejected(RejectReason.NON_FINITE, f"NaN or Inf in rank {spec.rank}'s slice")
            at = 0
            for start, length in spec.ranges:
                whole[start:start + length] = values[at:at + length]
                at += length
        reports = [p.progress for p in parts if p.progress is not None]
        first = parts[0]
        return replace(first, slice=None, payload=codec.encode(whole),
                       compute_s=max(p.compute_s for p in parts), step_time_s=max(p.step_time_s for p in parts),
                       progress=max(reports, key=lambda r: r.tokens) if reports else None)
