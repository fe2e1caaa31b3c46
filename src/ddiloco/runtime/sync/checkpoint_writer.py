"""Writing the synchronizer's checkpoints in the background, and restoring from the latest.

The core decides when a checkpoint is due and hands over its small state
(:meth:`~ddiloco.core.sync_side.synchronizer.Synchronizer.checkpoint_meta`); this writes it in the state
directory (:mod:`ddiloco.runtime.sync.state_dir`) a fragment at a time: each fragment is
copied on the core's thread, written off the event loop and let go before the next, so a
checkpoint holds one fragment beyond the steady state. One write runs at a time; a checkpoint
asked for while one is being written replaces any other still waiting (only the newest
matters, and waiting checkpoints must not pile up). A write that fails — a full disk, a
directory that went away — never stops the service: it is logged, counted and shown in
status with its error, beside the age of the last good checkpoint.

It keeps the round log too (:mod:`ddiloco.runtime.sync.round_log`): a restore replays the
rounds merged after the checkpoint, each checkpoint starts a new segment of the log before it
copies its first fragment and deletes the older segments once it is the latest. A restart
therefore resumes from the checkpoint and the log: every round merged before the crash.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Sequence

from ddiloco.runtime.sync.metrics import ServiceMetrics
from ddiloco.runtime.sync.round_log import LoggedRound, RoundLog, read_rounds
from ddiloco.runtime.sync.shutdown import StopDeadline
from ddiloco.runtime.sync.state_dir import StateDir, current_checkpoint, load_latest
from ddiloco.workload.checkpoint import CheckpointError

log = logging.getLogger("ddiloco.sync")

FetchFragment = Callable[[int], Awaitable[dict[str, Any]]]
"""A copy of one fragment's state, taken on the core's thread."""


class CheckpointWriter:
    def __init__(self, state_dir: StateDir | None, metrics: ServiceMetrics, fragments: Sequence[int],
                 identity: dict[str, object]) -> None:
        self.state_dir = state_dir
        self.identity = identity
        """What the round log's segments must name (the model's layout and the shard)."""
        self.round_log: RoundLog | None = None
        self.replayed = 0
        """Rounds the last restore replayed from the log."""
        self.metrics = metrics
        self.fragments = tuple(fragments)
        self.checkpoints = 0
        """Written, over every incarnation of the run."""
        self.failures = 0
        self.last_error = ""
        self.last_good_s: float | None = None
        self._fetch: FetchFragment | None = None
        self._next: tuple[dict[str, Any], dict[str, Any]] | None = None
        self._task: asyncio.Task | None = None

    def restore(self, layout_sha256: str, apply: Callable[[dict[str, Any]], None],
                replay: Callable[[LoggedRound], bool]) -> bool:
        """Hand the latest checkpoint to ``apply`` (the service, which restores its core and
        counters), if the state directory holds one of this model and layout, then every round
        the log holds after it to ``replay``; True if there was anything to restore. Opens the
        round log for the rounds to come."""
        if self.state_dir is None:
            return False
        try:
            restored, self.replayed = restore_state(self.state_dir.path, layout_sha256, self.identity, apply, replay)
            if restored is not None:
                self.checkpoints = int(restored["checkpoints"])
            self.round_log = RoundLog(self.state_dir.path, self.identity)
            return restored is not None or self.replayed > 0
        except BaseException:
            self.state_dir.close()
            raise

    def start(self, fetch: FetchFragment) -> None:
        """On the event loop that will run the writes; ``fetch`` copies a fragment on the core's thread."""
        self._fetch = fetch

    def submit(self, core_meta: dict[str, Any], service_state: dict[str, Any]) -> None:
        """Write this checkpoint in the background (after the write under way, replacing any other waiting)."""
        if self.state_dir is None:
            return
        self._next = (core_meta, service_state)
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._drain_queue())

    async def _drain_queue(self) -> None:
        while self._next is not None:
            core_meta, service_state = self._next
            self._next = None
            await self._write(core_meta, service_state)

    async def _write(self, core_meta: dict[str, Any], service_state: dict[str, Any]) -> None:
        assert self.state_dir is not None and self._fetch is not None
        started = time.perf_counter()
        number = self.checkpoints + 1
        state = {"core": core_meta, "service": {**service_state, "checkpoints": number}}
        draft = None
        log_from = None if self.round_log is None else await asyncio.wrap_future(self.round_log.rotate())
        if log_from is not None:
            state["service"]["round_log_from"] = log_from  # the rounds after this checkpoint's copies
        try:
            draft = await asyncio.to_thread(self.state_dir.begin, number)
            for p in self.fragments:
                fragment = await self._fetch(p)
                await asyncio.to_thread(draft.add_fragment, p, fragment)
                del fragment  # one fragment's copy at a time
            size = await asyncio.to_thread(draft.commit, state)
        except OSError as err:
            if draft is not None:
                draft.abandon()
            self.failures += 1
            self.last_error = f"{type(err).__name__}: {err}"
            log.error("checkpoint write to %s failed (%s); the last good one is %s", self.state_dir.path,
                      self.last_error, "none" if self.last_good_s is None else
                      f"{time.monotonic() - self.last_good_s:.0f}s old")
            return
        if log_from is not None:
            await asyncio.to_thread(self.round_log.drop_before, log_from)
        self.checkpoints = number
        self.last_good_s = time.monotonic()
        self.metrics.checkpoint_seconds.observe(time.perf_counter() - started)
        log.debug("checkpoint %d written (%d bytes)", number, size)

    async def drain(self) -> None:
        """Wait for the write under way and the one waiting, if any."""
        if self._task is not None:
            await self._task

    def close(self, stop: StopDeadline | None = None) -> None:
        """Close the round log (within ``stop``'s bound, if given) and the state directory."""
        if self.round_log is not None:
            if not self.round_log.close(None if stop is None else stop.left_s()):
                assert stop is not None
                stop.missed.append("the round log's last fsync")
                log.error("stopping: the round log's last records were not confirmed durable within the stop's "
                          "bound of %.0fs", stop.bound_s)
            self.round_log = None
        if self.state_dir is not None:
            self.state_dir.close()


def restore_state(path: Path, layout_sha256: str, identity: dict[str, object], apply: Callable[[dict[str, Any]], None],
                  replay: Callable[[LoggedRound], bool]) -> tuple[dict[str, Any] | None, int]:
    """The run's state in the state directory ``path``, read only: the latest checkpoint handed to
    ``apply`` (refused if it is of another model or layout), then every round the log holds after
    it to ``replay``. Returns the checkpoint's service state (None: no checkpoint) and the rounds
    replayed. A resuming synchronizer and ``ddiloco export`` rebuild Θ through this one path."""
    saved = load_latest(path)
    restored = None
    if saved is not None:
        where = current_checkpoint(path)
        if saved["service"]["layout_sha256"] != layout_sha256:
            raise CheckpointError(
                f"the checkpoint {where} belongs to a run with another model, fragmentation or codec: "
                "start with the same --preset/--config/--set/--init as the run that wrote it"
            )
        try:
            apply(saved)
        except (KeyError, ValueError, TypeError) as err:
            raise CheckpointError(f"the checkpoint {where} does not fit this synchronizer: {err}") from None
        restored = saved["service"]
    first = 0 if restored is None else int(restored.get("round_log_from", 0))
    try:
        replayed = sum(replay(r) for r in read_rounds(path, identity, first))
    except ValueError as err:
        raise CheckpointError(f"the round log in {path} does not follow the checkpoint: {err}") from None
    return restored, replayed
