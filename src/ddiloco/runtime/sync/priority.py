"""The synchronizer's network loop before its bulk work, on a host with few cores.

One thread, the asyncio loop, answers status, uploads and update streams. The bulk work
runs on threads of its own: the core's merges, checkpoint writes, state copies, handing
freed memory back. (The round log's writer keeps the loop's priority: every update waits
for it before it is streamed.) On a 2-core host those threads can keep both cores busy, and the loop waits its
turn for a core. Once it has one, it still waits for the GIL, which the others drop only
every 5 ms. At 1B parameters a status call took up to half a second.

So the bulk threads run at a lower scheduling priority (nice +10). When the loop and a bulk
thread both want a core, the loop gets about ten times the bulk thread's share. The loop
works in short bursts and is mostly idle, so the bulk work still gets nearly all of the
CPU. Linux sets a nice value per thread (``setpriority`` on the thread's id); elsewhere it
would apply to the whole process, so there the threads are left as they are.
"""

from __future__ import annotations

import os
import sys
import threading

BACKGROUND_NICE = 10
"""How much lower than the loop's the bulk threads' priority is (nice is -20..19)."""


def as_background() -> None:
    """Lower the calling thread's scheduling priority by ``BACKGROUND_NICE`` (Linux only)."""
    if sys.platform != "linux":
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + BACKGROUND_NICE))
    except OSError:  # a sandbox that forbids it: the thread keeps the loop's priority
        pass

