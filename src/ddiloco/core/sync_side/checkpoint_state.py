"""What a synchronizer's state is made of, copied out and restored: its fragments' values for
transfers, and checkpoints (the part of :class:`~ddiloco.core.sync_side.synchronizer.Synchronizer` that
saves and restores, kept apart from the protocol's decisions).

Copies are taken a fragment at a time: a join or a fetch copies each fragment as it sends it
(:meth:`CheckpointState.fragment_value`) and a checkpoint each fragment as it writes it
(:meth:`CheckpointState.fragment_state`), beside a few kilobytes of everything else
(:meth:`CheckpointState.checkpoint_meta`), so neither holds a copy of the whole model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import replace
from typing import Any, Iterable

from ddiloco.core.shared.codecs import Codec, fused_int4
from ddiloco.core.shared.messages import FragmentUpdate, FragmentValue, GlobalState
from ddiloco.core.sync_side.data_position import DataPositions
from ddiloco.core.sync_side.learner_record import Forgotten
from ddiloco.core.sync_side.outer import NesterovSGD
from ddiloco.core.sync_side.registry import Registry
from ddiloco.core.sync_side.rounds import GlobalFragment
from ddiloco.core.sync_side.run_state import RunState
from ddiloco.core.sync_side.status_snapshot import SyncCounters


class CheckpointState:
    incarnation: int
    _fragments: dict[int, GlobalFragment]
    _registry: Registry
    _positions: DataPositions
    _counters: SyncCounters
    _run: RunState
    _downlink: Codec
    _outer: NesterovSGD

    def fragment_value(self, fragment: int) -> FragmentValue:
        """A copy of one fragment's value with its version: what a transfer sends of it.

        Joins and state fetches copy the state one fragment at a time, as they send it, so a
        transfer holds one fragment beyond the steady state, never the whole model."""
        f = self._fragments[fragment]
        return FragmentValue(fragment, f.version, f.value.clone())

    def fragment_version(self, fragment: int) -> int:
        return self._fragments[fragment].version

    def state_for(self, state: GlobalState) -> GlobalState:
        """A join reply's state with every value copied now (drivers that send it at once: the virtual cluster, tests)."""
        return replace(state, fragments=self.global_state().fragments)

    def global_state(self) -> GlobalState:
        """Every fragment's value, copied at once, without registering anyone (evaluation, monitoring, tests)."""
        return GlobalState(tuple(self.fragment_value(p) for p in self._fragments), incarnation=self.incarnation)

    def state_dict(self, now: float = 0.0) -> dict[str, Any]:
        """Everything needed to resume, copied at once: values, optimizer state, residuals, versions, counters, run."""
        return {**self.checkpoint_meta(now), "fragments": [self.fragment_state(p) for p in self._fragments]}

    def fragment_state(self, fragment: int) -> dict[str, Any]:
        """A copy of one fragment's state (value, momentum, residual, version, norms) for a checkpoint."""
        return self._fragments[fragment].state_dict()

    def checkpoint_meta(self, now: float = 0.0) -> dict[str, Any]:
        """Everything :meth:`state_dict` holds but the fragments (a few kilobytes, whatever the model's size)."""
        return {
            "owned": list(self._fragments),
            "learners": self._registry.state_dict(),
            "data_positions": self._positions.state_dict(),
            **self._counters.state_dict(),
            "run": self._run.state_dict(now),
            "forgotten": dataclasses.asdict(self._registry.forgotten),
            "starved_episodes": self._registry.starved_episodes,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`. Learners must register again (leases are not restored)."""
        frags = state["fragments"]
        if list(state.get("owned", range(len(frags)))) != list(self._fragments):
            raise ValueError(f"checkpoint holds fragments {list(state.get('owned', range(len(frags))))}, "
                             f"this synchronizer owns {list(self._fragments)}")
        lean = fused_int4(self._downlink)
        for i, f in enumerate(self._fragments.values()):
            f.load_state_dict(frags[i], lean=lean)  # one fragment's saved state alive at a time (frags may read lazily)
        self._registry.load_state_dict(state["learners"])
        self._positions.load_state_dict(state.get("data_positions", {}))
        self._counters = SyncCounters.from_state(state)
        self._run.load_state_dict(state["run"])
        self._registry.forgotten = Forgotten(**{k: int(v) for k, v in state.get("forgotten", {}).items()})
        self._registry.starved_episodes = int(state.get("starved_episodes", 0))

    def replay_round(self, update: FragmentUpdate, *, plain: bool, reached: Iterable[tuple[str, int]] = ()) -> bool:
        """Redo a logged round after a restart (:class:`LogRound`; ``reached``: its learners' last
        steps, which move their data positions): False if the checkpoint already holds it;
        ValueError if it does not follow the fragment's version (a gap in the log)."""
        frag = self._fragments[update.fragment]
        if update.version <= frag.version:
            return False
        if update.version != frag.version + 1:
            raise ValueError(f"fragment {update.fragment}: the log goes from version {frag.version} "
                             f"to {update.version} (a gap)")
        frag.replay(update.payload, self._outer, self._downlink, plain=plain)
        self._positions.reached(update.fragment, reached)
        return True
