"""The Status call's one conversion: the core's status (:mod:`ddiloco.core.sync_side.status_snapshot`) to
protobuf on the synchronizer, protobuf to the dict ``ddiloco status --json`` prints on the client.

Both go by field name: a dataclass field travels in the message field of the same name
(``dataclasses.fields`` against the message's ``DESCRIPTOR``), and a reply becomes a dict of
its fields in the order the schema declares them. So a new status field is its dataclass field
and its field in ``ddiloco.proto``; what does not follow the rule is named here, once:

- :data:`ON_WIRE`: core fields whose wire name or unit differ;
- :data:`NOT_ON_WIRE`: core fields the reply does not carry;
- ``fragments``, ``versions`` and ``round_phases`` ride together, one ``FragmentStatus`` a fragment;
- :data:`DIGITS`, :data:`RENAMED`, :data:`GROUPED`: how the dict rounds, renames and nests.

What only the service measures (bytes, goodput, checkpoints) is added to the reply by
``runtime/sync/status_reply.py``; the dict takes it like any other field.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

from ddiloco.runtime.proto import ddiloco_pb2 as pb

if TYPE_CHECKING:  # the client half (``ddiloco status``) must not import the core: it imports torch
    from ddiloco.core.sync_side.status_snapshot import SyncStatus


class OnWire(NamedTuple):
    """A core field carried under another name, or in another unit (given the reply's ``now``)."""

    name: str
    out: Callable[[Any, float], Any] = lambda value, now: value


ON_WIRE: dict[str, OnWire] = {
    "learner_id": OnWire("id"),
    "last_seen_s": OnWire("last_seen_s_ago", lambda seen, now: now - seen if seen else -1.0),
}
"""Core field -> how it travels, where not under its own name as it is."""
NOT_ON_WIRE = frozenset({"started_at_s"})
"""Core fields the Status reply does not carry (``SyncStatus.started_at_s``: the run's clock is ``elapsed_s``)."""
_BY_FRAGMENT = ("fragments", "versions", "round_phases")
"""Per-fragment core fields: one ``FragmentStatus`` (id, version) and one ``round_phases`` entry a fragment."""


LEARNERS_PAGE = 1000
"""Learners per Status reply when the caller asks for no page size (and the most it may ask for)."""


def wire_name(name: str) -> str:
    """The message field that carries core field ``name``."""
    return ON_WIRE[name].name if name in ON_WIRE else name


# ---- the core's status to protobuf (the synchronizer) ---------------------------------------


def status_to_pb(core: SyncStatus, now: float) -> pb.StatusReply:
    """Every field of ``core`` in a StatusReply (``now``: the clock of ``core``'s times)."""
    from ddiloco.core.sync_side.run_state import RunPhase

    reply = pb.StatusReply(finished=core.phase is RunPhase.FINISHED)
    to_pb(core, reply, now, skip=_BY_FRAGMENT)
    for index, version in zip(core.fragments, core.versions):
        reply.fragments.add(id=index, version=version)
    reply.round_phases.extend(str(p) for p in core.round_phases)
    return reply


def to_pb(value: Any, message: Any, now: float, skip: tuple[str, ...] = ()) -> Any:
    """Fill ``message`` from the dataclass ``value``, field by field by name; returns ``message``.

    A field with no field of its name in the message (and not in :data:`NOT_ON_WIRE`) is an
    error: it would silently not reach the status."""
    descriptor = message.DESCRIPTOR
    for f in dataclasses.fields(value):
        if f.name in skip or f.name in NOT_ON_WIRE:
            continue
        on_wire = ON_WIRE.get(f.name, OnWire(f.name))
        target = descriptor.fields_by_name.get(on_wire.name)
        if target is None:
            raise KeyError(f"{type(value).__name__}.{f.name} has no field {on_wire.name!r} in {descriptor.name} "
                           f"(runtime/proto/ddiloco.proto) and is not in status.wire_form.NOT_ON_WIRE")
        _put(message, target, on_wire.out(getattr(value, f.name), now), now)
    return message


def _put(message: Any, target: Any, value: Any, now: float) -> None:
    if value is None:  # proto3 has no "unset" for a scalar: None travels as the default (0)
        return
    if isinstance(value, enum.Enum):
        value = value.value
    if not target.is_repeated:
        setattr(message, target.name, value)
        return
    field = getattr(message, target.name)
    if isinstance(value, dict):  # a count by key
        for key, count in sorted(value.items()):
            field.add(key=key, count=count)
    elif target.message_type is not None:
        for item in value:
            to_pb(item, field.add(), now)
    else:
        field.extend(v.value if isinstance(v, enum.Enum) else v for v in value)


# ---- protobuf to the dict of ``ddiloco status --json`` (the client) -------------------------


DIGITS: dict[str, int] = {"grace_window_s": 6, "grace_quorum_s": 6, "grace_sync_s": 6, "goodput": 6,
                          "model_uptime": 6, "step_time_s": 6}
"""Decimals a float field keeps in the dict, where not 3 (seconds to the millisecond)."""
RENAMED: dict[str, str] = {"uptime_s": "uptime"}
"""Reply field -> its key in the dict, where not its own name."""
GROUPED: dict[str, tuple[str, str]] = {
    "quorum": ("quorum", "required"), "effective_quorum": ("quorum", "effective"),
    "rounds_closed": ("quorum", "rounds_closed"),
    "grace_window_s": ("grace", "window_s"), "grace_quorum_s": ("grace", "quorum_s"),
    "grace_sync_s": ("grace", "sync_s"),
}
"""Reply field -> (group, key): the dict nests these under the group, where the first of them stands."""


def status_to_dict(reply: pb.StatusReply) -> dict[str, Any]:
    """The JSON of ``ddiloco status --json`` (and of the status page's ``/api/status``): every
    field of the reply, in the schema's order, plus ``instance_id``; each fragment with its round."""
    fields = message_dict(reply)
    rounds = fields.pop("round_phases")
    for i, fragment in enumerate(fields["fragments"]):
        fragment["round"] = rounds[i] if i < len(rounds) else ""
    fields["shards"] = fields["shards"] or 1  # 0: a synchronizer older than sharding
    return {"instance_id": f"{reply.incarnation:x}", **presented(fields)}


def presented(fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` (by reply field name) keyed as the dict shows them: :data:`RENAMED`, :data:`GROUPED`.
    The sharded merge keys its rules with it too."""
    out: dict[str, Any] = {}
    for name, value in fields.items():
        if name in GROUPED:
            group, key = GROUPED[name]
            out.setdefault(group, {})[key] = value
        else:
            out[RENAMED.get(name, name)] = value
    return out


def message_dict(message: Any) -> dict[str, Any]:
    """A message's fields by name, in declaration order: counts by key as dicts, floats rounded."""
    out: dict[str, Any] = {}
    for target in message.DESCRIPTOR.fields:
        value = getattr(message, target.name)
        if target.message_type is pb.CountEntry.DESCRIPTOR:
            value = {e.key: e.count for e in value}
        elif target.message_type is not None:
            value = [message_dict(m) for m in value] if target.is_repeated else message_dict(value)
        elif target.is_repeated:
            value = list(value)
        elif target.type == target.TYPE_DOUBLE:
            value = round(value, DIGITS.get(target.name, 3))
        out[target.name] = value
    return out
