"""Refusals said once per reason, and the jittered backoff of a learner's retries (shared by the
training process's link and its helper process)."""

from __future__ import annotations

import logging
import random
import time
from typing import Callable

from ddiloco.core.learner_side.shard_link import backoff_after

REPEAT_EVERY_S = 30.0
"""A refusal repeated for the same reason is logged again at most this often, with its count."""


class Repeats:
    """Refusals logged once per reason and then summarized: on a slow link every contribution may
    be refused alike (``stale``), and a line per call buries everything else in the log."""

    def __init__(self, logger: logging.Logger, clock: Callable[[], float] = time.monotonic) -> None:
        self._log = logger
        self._clock = clock
        self._said: dict[object, tuple[float, int]] = {}
        """Per key: when it was last logged, and how many times it came since."""

    def say(self, key: object, fmt: str, *args: object, level: int = logging.INFO) -> None:
        """Log at ``level`` the first time for ``key``, then at most every ``REPEAT_EVERY_S`` with a count."""
        now = self._clock()
        said = self._said.get(key)
        if said is None or now - said[0] >= REPEAT_EVERY_S:
            repeats = f" ({said[1]} more like it in the last {now - said[0]:.0f} s)" if said and said[1] else ""
            self._log.log(level, fmt + "%s", *args, repeats)
            self._said[key] = (now, 0)
        else:
            self._said[key] = (said[0], said[1] + 1)
            self._log.debug(fmt, *args)


def next_delay(delay: float) -> float:
    """The core's backoff with ±20% jitter, so that many learners do not call back in step."""
    return backoff_after(delay) * random.uniform(0.8, 1.2)
