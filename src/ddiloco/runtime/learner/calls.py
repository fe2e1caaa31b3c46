"""The calls a learner's training process hands its link's helper, remembered until each one's
outcome (or its helper's death) comes back.

Each call has a request id and the *generation* of the helper it went to: every helper started
after one died is a new generation, and the calls of earlier ones (or that went to none) are lost
with the helper that had them; the link reports them undelivered when the new helper starts, and
the core's usual rules take it from there. Within :meth:`HelperCalls.batched` one thread's calls
(a step's announces) are held back and sent together, one system call, one wake-up of the helper
rather than one per message; a held call whose helper died meanwhile is not sent to its
successor (it was reported lost when the successor started).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from typing import Iterator

from ddiloco.core.shared.messages import Request
from ddiloco.runtime.learner.helper_process import HelperProcess
from ddiloco.runtime.learner.helper_wire import PipeClosed


class HelperCalls:
    """The calls in flight to the link's helper, and the helper running now."""

    def __init__(self) -> None:
        self.helper: HelperProcess | None = None
        self.generation = 0
        self.lock = threading.Lock()
        self.requests: dict[int, tuple[Request, int, int]] = {}
        """In flight: per request id, the request, its shard and the helper generation it went to."""
        self._rids = itertools.count()
        self._held: list[tuple[int, bytes]] | None = None
        """Frames held back until the end of ``batched``, each with the helper generation it is for."""
        self._holder = 0
        """The thread whose frames are held back."""

    def next_rid(self) -> int:
        return next(self._rids)

    def call(self, rid: int, request: Request, shard: int, frame: bytes) -> None:
        """Send the framed call ``rid`` to the helper now (or at the end of ``batched``)."""
        with self.lock:
            generation, helper = -1, self.helper  # -1: not sent, lost with the helper that is gone
            self.requests[rid] = (request, shard, generation)
            if helper is not None:
                if self._held is not None and threading.get_ident() == self._holder:
                    self._held.append((self.generation, frame))
                    generation = self.generation
                else:
                    try:
                        helper.pipe.send_frames(frame)
                        generation = self.generation
                    except PipeClosed:
                        pass  # the relay sees it die, and reports the call undelivered
            self.requests[rid] = (request, shard, generation)

    @contextlib.contextmanager
    def batched(self) -> Iterator[None]:
        """Within: this thread's calls are held back, then sent in one system call. Never around a
        wait for the helper: what it waits for might be held back."""
        self._holder, self._held = threading.get_ident(), []
        try:
            yield
        finally:
            held, self._held = self._held, None
            if held:
                self._send_held(held)

    def _send_held(self, held: list[tuple[int, bytes]]) -> None:
        with self.lock:
            helper, generation = self.helper, self.generation
            data = b"".join(frame for gen, frame in held if gen == generation)
            if helper is None or not data:
                return
            try:
                helper.pipe.send_frames(data)
            except PipeClosed:
                pass  # the relay sees it die, and reports the calls undelivered

    def started(self, helper: HelperProcess) -> list[int]:
        """A new helper runs; the calls lost with its predecessors (or sent to none)."""
        with self.lock:
            self.helper = helper
            return [rid for rid, (_, _, gen) in self.requests.items() if gen < self.generation]

    def gone(self) -> None:
        """The helper died: what follows goes to the next generation."""
        with self.lock:
            self.helper = None
            self.generation += 1

    def done(self, rid: int) -> tuple[Request, int] | None:
        """Forget call ``rid`` (its outcome came back); its request and shard, None if unknown. Under
        the lock: an outcome can come back while :meth:`call` is still recording the call it sent
        (a heartbeat answered at once), and without it that record would bring the call back, never
        to end (a closing learner's flush waited for it without end)."""
        with self.lock:
            entry = self.requests.pop(rid, None)
        return None if entry is None else entry[:2]
