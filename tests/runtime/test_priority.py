"""The synchronizer's bulk threads give way to its network loop (``runtime/sync/priority.py``)."""

from __future__ import annotations

import asyncio
import os
import sys
import threading

import pytest
from test_service import tiny

from ddiloco.runtime.sync.priority import BACKGROUND_NICE

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="per-thread priorities are Linux's")


def nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_merges_checkpoints_and_state_copies_run_below_the_loop(inproc_sync) -> None:
    s = inproc_sync(tiny())
    loop_nice = s.call(nice)
    core_nice = s.call(lambda: s.service.host.query(lambda core: nice()))
    bulk_nice = s.call(lambda: asyncio.to_thread(nice))
    assert loop_nice == nice()  # the loop keeps the process's priority
    assert core_nice == bulk_nice == min(19, loop_nice + BACKGROUND_NICE)
