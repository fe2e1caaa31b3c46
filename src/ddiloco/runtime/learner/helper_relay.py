"""Keeping a link's helper process running, for both links (``link.py``, ``fsdp/rank_link.py``).

A relay thread starts the helper, hands every message it reports to its link, and when the helper
dies rather than closes, starts another: the in slots the dead one wrote without announcing are
free again, the calls it had in flight go to the link as lost (its core counts them undelivered),
and the link tells the new one what it must know (the stream to follow). What a lost call or a
message means is the link's; how a helper is started, replaced and closed is written here once.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Protocol

from ddiloco.runtime.learner.calls import HelperCalls
from ddiloco.runtime.learner.helper_process import HelperError, HelperProcess
from ddiloco.runtime.learner.helper_wire import HelperSpec, Msg, PipeClosed
from ddiloco.runtime.learner.slots import Slot, SlotArea

log = logging.getLogger("ddiloco.learner")


class RelayedLink(Protocol):
    """What a link gives the relay that keeps its helper running."""

    def helper_spec(self) -> HelperSpec:
        """What the next helper is started with."""

    def adopt(self, helper: HelperProcess) -> None:
        """A helper runs (the first, or one that replaced a dead one): record it in the link's
        :class:`HelperCalls` and report the calls lost with its predecessor."""

    def serve(self, helper: HelperProcess) -> None:
        """Take what ``helper`` reports until it closes or dies."""


class HelperRelay:
    """The relay thread of one link: its helper started, served, replaced when it dies, closed."""

    def __init__(self, link: RelayedLink, slots: SlotArea, holding: set[int], calls: HelperCalls, *, name: str,
                 what: str, failed: Callable[[HelperError], None], stopped: Callable[[], bool] = lambda: False) -> None:
        self.link = link
        self.slots = slots
        self.holding = holding
        """The link's fragments whose in slot holds an update its training thread has not released yet."""
        self.calls = calls
        self.what = what
        """The helper, in a log line ("the link's helper process", "rank 1's link helper")."""
        self.failed = failed
        """Told when a replacement cannot start (the first helper's failure is :meth:`start`'s)."""
        self.stopped = stopped
        """The link gave up (a fatal refusal): a helper that dies then is not replaced."""
        self.restarts = 0
        """Helpers that died and were replaced."""
        self._closing = False
        self._started = threading.Event()
        self._start_error: HelperError | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)  # the helper dies with it

    def start(self) -> None:
        """Start the first helper and wait until it runs (``HelperError``, one line, if it cannot)."""
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            raise self._start_error

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout_s: float, last_calls: Callable[[], None] = lambda: None) -> None:
        """Make ``last_calls`` (a leave), then the helper delivers what is queued and exits."""
        self._closing = True
        helper = self.calls.helper
        if helper is not None and self._thread.is_alive():
            last_calls()
            try:
                helper.pipe.send(Msg.CLOSE, timeout_s)
            except PipeClosed:
                pass
            self._thread.join(timeout_s)
        if helper is not None:
            helper.wait(timeout_s if self._thread.is_alive() else 5.0)

    def _loop(self) -> None:
        while True:
            self.slots.release_all(Slot.IN, set(self.holding))  # a dead helper may have written unannounced
            try:
                helper = HelperProcess.start(self.link.helper_spec(), self.slots.fd)
            except Exception as err:  # noqa: BLE001  # whatever it is, the link must hear of it, not hang
                err = err if isinstance(err, HelperError) else HelperError(f"{self.what}: {err}")
                if self._started.is_set():
                    self.failed(err)
                else:
                    self._start_error = err
                    self._started.set()
                return
            self.link.adopt(helper)
            self._started.set()
            self.link.serve(helper)
            if self._closing or self.stopped():
                return
            self.calls.gone()
            self.restarts += 1
            log.warning("%s (pid %d) %s; starting a new one (its %d calls in flight count as undelivered; "
                        "training goes on)", self.what, helper.pid, helper.exit_line(), len(self.calls.requests))
            helper.kill()
