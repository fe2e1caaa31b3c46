"""Writing the synchronizer's checkpoints in the background, and restoring from the latest.

The core decides when a checkpoint is due; this writes it (atomically, in the state
directory: :mod:`ddiloco.runtime.sync.state_dir`) off the event loop, one write at a time. A write
that fails — a full disk, a directory that went away — never stops the service: it is
logged, counted and shown in status with its error, beside the age of the last good
checkpoint, which is what a restart would resume from.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from ddiloco.runtime.checkpoint import CheckpointError
from ddiloco.runtime.sync.metrics import ServiceMetrics
from ddiloco.runtime.sync.state_dir import StateDir

log = logging.getLogger("ddiloco.sync")


class CheckpointWriter:
    def __init__(self, state_dir: StateDir | None, metrics: ServiceMetrics) -> None:
        self.state_dir = state_dir
        self.metrics = metrics
        self.checkpoints = 0
        """Written, over every incarnation of the run."""
        self.failures = 0
        self.last_error = ""
        self.last_good_s: float | None = None
        self._writes: set[asyncio.Task] = set()
        self._lock: asyncio.Lock | None = None

    def restore(self, layout_sha256: str, apply: Callable[[dict[str, Any]], None]) -> bool:
        """Hand the latest checkpoint to ``apply`` (the service, which restores its core and
        counters), if the state directory holds one of this model and layout; True if it did."""
        if self.state_dir is None:
            return False
        try:
            saved = self.state_dir.load()
            if saved is None:
                return False
            if saved["service"]["layout_sha256"] != layout_sha256:
                raise CheckpointError(
                    "the checkpoint belongs to a run with another model, fragmentation or codec: "
                    "start with the same --preset/--config/--set as the run that wrote it"
                )
            try:
                apply(saved)
            except (KeyError, ValueError) as err:
                raise CheckpointError(f"checkpoint does not fit this synchronizer: {err}") from None
            self.checkpoints = int(saved["service"]["checkpoints"])
            return True
        except BaseException:
            self.state_dir.close()
            raise

    def start(self) -> None:
        """On the event loop that will run the writes."""
        self._lock = asyncio.Lock()

    def submit(self, core_state: dict[str, Any], service_state: dict[str, Any]) -> None:
        """Write this state in the background (after any write under way)."""
        if self.state_dir is None:
            return
        state = {"core": core_state, "service": {**service_state, "checkpoints": self.checkpoints + 1}}
        task = asyncio.ensure_future(self._write(state))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write(self, state: dict[str, Any]) -> None:
        assert self.state_dir is not None and self._lock is not None
        async with self._lock:
            started = time.perf_counter()
            try:
                size = await asyncio.to_thread(self.state_dir.save, state)
            except OSError as err:
                self.failures += 1
                self.last_error = f"{type(err).__name__}: {err}"
                log.error("checkpoint write to %s failed (%s); the last good one is %s", self.state_dir.path,
                          self.last_error, "none" if self.last_good_s is None else
                          f"{time.monotonic() - self.last_good_s:.0f}s old")
                return
            self.checkpoints += 1
            self.last_good_s = time.monotonic()
            self.metrics.checkpoint_seconds.observe(time.perf_counter() - started)
            log.debug("checkpoint %d written (%d bytes)", self.checkpoints, size)

    async def drain(self) -> None:
        """Wait for every write under way."""
        await asyncio.gather(*list(self._writes))

    def close(self) -> None:
        if self.state_dir is not None:
            self.state_dir.close()
