"""The Status call carries every field of the core's status (issue 28): a status whose every
field differs from its default goes core -> protobuf -> bytes -> protobuf -> the ``--json``
dict, and each field must come out. The values are drawn from the fields' types, so a field
added to ``SyncStatus`` or ``LearnerStatus`` is checked here without editing this file."""

from __future__ import annotations

import dataclasses
import enum
import itertools
import typing
from types import UnionType

import pytest

from ddiloco.core.sync_side.rounds import RoundPhase
from ddiloco.core.sync_side.run_state import RunPhase
from ddiloco.core.sync_side.status_snapshot import LearnerStatus, ShardMerge, SyncStatus
from ddiloco.runtime import sharded
from ddiloco.runtime.proto import ddiloco_pb2 as pb
from ddiloco.runtime.sharded import merge_statuses
from ddiloco.runtime.status.wire_form import GROUPED, NOT_ON_WIRE, presented, status_to_dict, status_to_pb, wire_name

NOW = 1000.0
PER_FRAGMENT = ("fragments", "versions", "round_phases")
GROUPS = {group for group, _ in GROUPED.values()}


def drawn(cls: type, seed: int) -> typing.Any:
    """An instance of the status dataclass ``cls`` with no field at its default: numbers exact in
    binary and to the millisecond (the dict rounds floats), enums not their first member."""
    count = itertools.count(seed * 100 + 3)
    hints = typing.get_type_hints(cls)

    def value(name: str, hint: typing.Any) -> typing.Any:
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if origin is UnionType or origin is typing.Union:
            return value(name, next(a for a in args if a is not type(None)))
        if hint is bool:
            return True
        if hint is int:
            return next(count)
        if hint is float:
            return next(count) + 0.5
        if hint is str:
            return f"{name}-{next(count)}"
        if isinstance(hint, type) and issubclass(hint, enum.Enum):
            return list(hint)[-1 - seed % (len(hint) - 1)]
        if origin is dict:
            return {f"{name}-a": next(count), f"{name}-b": next(count)}
        if origin is tuple and args[0] is RoundPhase:
            return (RoundPhase.GRACE, RoundPhase.COLLECTING)
        if origin is tuple and args[0] is LearnerStatus:
            return tuple(drawn(LearnerStatus, seed * 10 + i) for i in range(2))
        if origin is tuple and args[0] is int:
            return (next(count) % 50, next(count) % 50 + 50)
        raise AssertionError(f"{cls.__name__}.{name}: teach drawn() the type {hint}")

    return cls(**{f.name: value(f.name, hints[f.name]) for f in dataclasses.fields(cls)})


def plain(value: typing.Any) -> typing.Any:
    """A core value as the dict shows it."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):
        return [plain(v) for v in value]
    return value


def through_the_wire(core: SyncStatus) -> dict:
    reply = pb.StatusReply.FromString(status_to_pb(core, NOW).SerializeToString())
    return status_to_dict(reply)


def test_every_field_of_the_core_status_reaches_the_json_dict() -> None:
    core = drawn(SyncStatus, 0)
    shown = through_the_wire(core)
    for f in dataclasses.fields(SyncStatus):
        if f.name in NOT_ON_WIRE or f.name in PER_FRAGMENT + ("learners",):
            continue
        expected = presented({wire_name(f.name): plain(getattr(core, f.name))})
        for key, value in expected.items():
            got = {k: shown[key][k] for k in value} if key in GROUPS else shown[key]
            assert got == value, f"SyncStatus.{f.name}"
    assert [(fr["id"], fr["version"], fr["round"]) for fr in shown["fragments"]] == list(
        zip(core.fragments, core.versions, plain(core.round_phases)))
    assert shown["finished"] is (core.phase is RunPhase.FINISHED)
    assert len(shown["learners"]) == len(core.learners) == 2
    for learner, row in zip(core.learners, shown["learners"]):
        for f in dataclasses.fields(LearnerStatus):
            expected = NOW - learner.last_seen_s if f.name == "last_seen_s" else plain(getattr(learner, f.name))
            assert row[wire_name(f.name)] == expected, f"LearnerStatus.{f.name}"


def test_only_the_runs_start_stays_off_the_wire() -> None:
    """A field left off the wire must be named in status.wire_form.NOT_ON_WIRE, and on purpose: this
    list is the one to argue with."""
    assert NOT_ON_WIRE == {"started_at_s"}


def test_a_core_field_without_a_wire_field_is_a_loud_error() -> None:
    @dataclasses.dataclass(frozen=True)
    class Newer(SyncStatus):
        brand_new_count: int = 1

    core = drawn(SyncStatus, 0)
    newer = Newer(**{f.name: getattr(core, f.name) for f in dataclasses.fields(SyncStatus)})
    with pytest.raises(KeyError, match="brand_new_count.*ddiloco.proto"):
        status_to_pb(newer, NOW)


def test_a_sharded_run_merges_each_field_by_its_rule() -> None:
    a, b = drawn(SyncStatus, 1), drawn(SyncStatus, 2)
    b = dataclasses.replace(b, learners=(b.learners[0], dataclasses.replace(a.learners[1], tokens=1, rejected=5)))
    shards = [through_the_wire(a), through_the_wire(b)]
    merged = merge_statuses(shards)
    assert merged["per_shard"] == shards and list(merged)[:-1] == list(shards[0])
    assert merged["instance_id"] == f"{a.incarnation:x},{b.incarnation:x}"
    assert merged["tokens"] == min(a.tokens, b.tokens) and merged["tokens_left"] == max(a.tokens_left, b.tokens_left)
    assert merged["pending_tokens"] == a.pending_tokens + b.pending_tokens
    assert merged["incarnation"] == a.incarnation and merged["learners_forgotten"] == a.learners_forgotten
    assert merged["phase"] == (a.phase if a.phase == b.phase else "mixed")
    assert merged["rejections"] == summed(a.rejections, b.rejections)
    assert merged["quorum"]["rounds_closed"] == summed(a.rounds_closed, b.rounds_closed)
    assert merged["claims_clipped"] == summed(a.claims_clipped, b.claims_clipped)
    assert merged["quorum"]["required"] == a.quorum and merged["grace"] == shards[0]["grace"]
    assert [f["id"] for f in merged["fragments"]] == sorted([*a.fragments, *b.fragments])
    by_id = {lr["id"]: lr for lr in merged["learners"]}
    assert sorted(by_id) == sorted({a.learners[0].learner_id, a.learners[1].learner_id, b.learners[0].learner_id})
    both = by_id[a.learners[1].learner_id]  # at both shards
    assert both["rejected"] == a.learners[1].rejected + 5 and both["tokens"] == a.learners[1].tokens
    assert both["data_position"] == a.learners[1].data_position and both["alive"] is True


def summed(x: dict[str, int], y: dict[str, int]) -> dict[str, int]:
    return {k: x.get(k, 0) + y.get(k, 0) for k in {*x, *y}}


def test_every_merge_rule_is_implemented() -> None:
    assert set(sharded._RULES) == set(ShardMerge)
