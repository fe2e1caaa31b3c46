"""One stop's deadline, shared by every wait of the synchronizer's shutdown path.

A SIGTERM must end the synchronizer in bounded time whatever its callers and streams are doing
(issue 59: after a flood of abandoned joins the stop once waited for good on a round log whose
thread had died). So nothing on the shutdown path waits without this: each wait gets what is
left of :func:`~ddiloco.core.shared.deadlines.stop_deadline_s`, and one that runs out is given up,
named in one line and remembered, so that the last line of the stop says what was not done.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable

log = logging.getLogger("ddiloco.sync")


class StopDeadline:
    def __init__(self, bound_s: float) -> None:
        self.bound_s = bound_s
        self._until = time.monotonic() + bound_s
        self.missed: list[str] = []
        """What the stop gave up waiting for, in order."""

    def left_s(self) -> float:
        return max(0.0, self._until - time.monotonic())

    async def wait(self, work: Awaitable[object], what: str) -> bool:
        """Wait for ``work`` until the stop's deadline; False (and ``what`` logged and remembered) if it ran out."""
        try:
            await asyncio.wait_for(work, self.left_s())
        except asyncio.TimeoutError:
            self.missed.append(what)
            log.error("stopping: gave up waiting for %s (the stop's bound of %.0fs ran out)", what, self.bound_s)
            return False
        return True
