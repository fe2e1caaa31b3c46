"""Every kind of fault, named once: the virtual cluster's adversary and ``ddiloco chaos`` share them.

A kind declares where it can be injected (:class:`Injector`): on the virtual cluster's links
or processes, on a real link, or on a real process. The simulator draws the kinds it can
inject (``faults.*`` rates, ``ddiloco simtest --faults``), ``ddiloco chaos`` schedules the
kinds it can inject (schedule files, chaos.json), and each refuses the others by name. Adding
a kind is a member here with its injectors, then the code of each injector it names
(docs/design.md, "How to add a fault kind").
"""

from __future__ import annotations

import enum

from ddiloco.core.shared.errors import ConfigError


class Injector(enum.Enum):
    """Where a fault is carried out; the value names the code that does it."""

    VIRTUAL_LINK = "sim/network.py: the virtual links drop, copy, delay or cut a message"
    VIRTUAL_PROCESS = "sim/adversary.py draws it, sim/fate.py carries it out on a virtual process"
    REAL_LINK = "chaos/cluster.py: the fault-injecting proxy (chaos/proxy.py), or the link itself under --hosts netns"
    REAL_PROCESS = "chaos/runner.py: a signal to a real process (kill -9, SIGSTOP), and its restart"


class FaultKind(enum.StrEnum):
    """One kind of fault. Members keep the order ``ddiloco chaos`` shuffles its seeded schedules from."""

    LOSS = "loss"
    """A message is lost."""
    DUPLICATE = "duplicate"
    """A message is delivered twice."""
    REORDER = "reorder"
    """A message is held back by a delay spike, so later ones overtake it."""
    LEARNER_CRASH = "learner_crash"
    """A learner's process dies (kill -9) and restarts after a while with the same id; it rejoins by itself."""
    FREEZE = "freeze"
    """A learner's process stays alive but silent (SIGSTOP), longer than its lease: it must rejoin."""
    SYNC_CRASH = "sync_crash"
    """The synchronizer (or one shard of it) dies and restarts from its last checkpoint."""
    LATENCY = "latency"
    """Delay added to every byte of a learner's link, both ways."""
    BANDWIDTH = "bandwidth"
    """A learner's link capped, each way."""
    RESET = "reset"
    """A learner's connections reset (RST), new ones too, for a while."""
    PARTITION = "partition"
    """Nothing passes either way on a learner's link for a while."""
    JOIN_FLOOD = "join_flood"
    """A member holding the run's token registers under new ids by the dozen each second, and abandons
    every join: some before the state arrived, the others once it did (their leases then run)."""
    STALL = "stall"
    """A learner's uploads stall after their first bytes while small messages pass (a path-MTU black
    hole): the synchronizer holds each upload's place until its deadline, then ends it ``timed_out``,
    and refuses another of the same fragment meanwhile (``busy``)."""

    @property
    def injectors(self) -> frozenset[Injector]:
        return _INJECTORS[self]

    @property
    def on_link(self) -> bool:
        """Injected on a learner's link (virtual or real) rather than on a process."""
        return bool(self.injectors & {Injector.VIRTUAL_LINK, Injector.REAL_LINK})

    @property
    def simulated(self) -> bool:
        """The virtual cluster can inject it."""
        return bool(self.injectors & {Injector.VIRTUAL_LINK, Injector.VIRTUAL_PROCESS})

    @property
    def real(self) -> bool:
        """``ddiloco chaos`` can inject it into real processes and links."""
        return bool(self.injectors & {Injector.REAL_LINK, Injector.REAL_PROCESS})


_INJECTORS: dict[FaultKind, frozenset[Injector]] = {
    FaultKind.LOSS: frozenset({Injector.VIRTUAL_LINK}),
    FaultKind.DUPLICATE: frozenset({Injector.VIRTUAL_LINK}),
    FaultKind.REORDER: frozenset({Injector.VIRTUAL_LINK}),
    FaultKind.LEARNER_CRASH: frozenset({Injector.VIRTUAL_PROCESS, Injector.REAL_PROCESS}),
    FaultKind.FREEZE: frozenset({Injector.VIRTUAL_PROCESS, Injector.REAL_PROCESS}),
    FaultKind.SYNC_CRASH: frozenset({Injector.VIRTUAL_PROCESS, Injector.REAL_PROCESS}),
    FaultKind.LATENCY: frozenset({Injector.REAL_LINK}),
    FaultKind.BANDWIDTH: frozenset({Injector.REAL_LINK}),
    FaultKind.RESET: frozenset({Injector.REAL_LINK}),
    FaultKind.JOIN_FLOOD: frozenset({Injector.VIRTUAL_PROCESS}),
    FaultKind.PARTITION: frozenset({Injector.VIRTUAL_LINK, Injector.REAL_LINK}),
    FaultKind.STALL: frozenset({Injector.VIRTUAL_LINK}),
}

SIMULATED: tuple[FaultKind, ...] = tuple(k for k in FaultKind if k.simulated)
"""What ``ddiloco simtest`` can draw and the virtual cluster can inject."""
REAL: tuple[FaultKind, ...] = tuple(k for k in FaultKind if k.real)
"""What ``ddiloco chaos`` can inject."""


def parse_kind(text: str, allowed: tuple[FaultKind, ...], tool: str) -> FaultKind:
    """The kind named ``text``, which ``tool`` (the one injecting ``allowed``) must be able to
    inject; else a ConfigError naming it and the tool that can."""
    try:
        kind = FaultKind(text)
    except ValueError:
        raise ConfigError(f"unknown fault kind {text!r} (kinds: {', '.join(allowed)})") from None
    if kind not in allowed:
        other = "ddiloco chaos (real processes and links)" if kind.real else "the virtual cluster (ddiloco simtest)"
        raise ConfigError(f"{tool} cannot inject {kind} faults, only {other} can (kinds here: {', '.join(allowed)})")
    return kind
