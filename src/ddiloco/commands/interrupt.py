"""SIGTERM unwinds a command like Ctrl-C, so what it has done so far is written before it exits."""

from __future__ import annotations

import contextlib
import signal
from types import FrameType
from typing import Iterator


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """While inside, SIGTERM (``kill``, ``scancel``, a CI timeout) raises KeyboardInterrupt in the main thread."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
