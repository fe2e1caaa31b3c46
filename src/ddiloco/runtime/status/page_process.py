"""The status page in a process of its own, fed a snapshot of the synchronizer's status.

Why a process: at 1B parameters the synchronizer's event loop shares one GIL with the core's
thread (merges, checkpoint copies) on a host whose cores are busy, and a call the loop answers
waits, at its slowest, 100-200 ms for a turn (docs/runtime.md). A page served from another
process has a GIL and a scheduler slot of its own: it answers an operator at once, however
busy the synchronizer is, and says how old its news is (``age_s``), so a stalled or stopped
synchronizer shows as one that has gone quiet, not as a page that hangs.

The synchronizer's loop writes the status dict (:func:`status_to_dict` of the Status reply)
every :data:`PUBLISH_EVERY_S` to a small file in memory (``/dev/shm``), atomically (write,
then rename): the page reads it whole or not at all, and the synchronizer never waits on the
page. The page process exits when its standard input closes, which the kernel does when the
synchronizer exits, ``kill -9`` included: no orphan keeps serving a dead run's status.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

from ddiloco.core.shared.errors import ConfigError, DdilocoError
from ddiloco.runtime.auth import Address

log = logging.getLogger("ddiloco.sync")

PUBLISH_EVERY_S = 0.25
"""How often the synchronizer's loop writes its status for the page (a few kB each time)."""
READY_TIMEOUT_S = 60.0
"""How long the synchronizer waits for the page process to bind its port and say so."""
SNAPSHOT = "status.json"


class StatusPageProcess:
    """``ddiloco sync --http-port``: the page process, started (its port bound) at construction so
    that a port in use fails before the synchronizer loads its model; fed by :meth:`publish`."""

    def __init__(self, bind: Address, token: str | None) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="ddiloco-status-", dir=_memory_folder()))
        self.snapshot = self.folder / SNAPSHOT
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ddiloco.runtime.status.page_process", bind.host, str(bind.port), str(self.folder)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps({"token": token}) + "\n")  # not on the command line, where ps shows it
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # it exited at once: what it said, if anything, is read below
        answer = _read_line(self.proc.stdout, READY_TIMEOUT_S)
        reply = json.loads(answer) if answer.startswith("{") else {}
        if "port" not in reply:
            self.close()
            if "error" in reply:
                raise ConfigError(reply["error"])
            raise DdilocoError(f"the status page process did not start (it said {answer.strip()!r}; exit code "
                               f"{self.proc.returncode})")
        self.port: int = reply["port"]
        self.url: str = reply["url"]
        log.info("status page at %s (process %d)", self.url, self.proc.pid)

    async def publish(self, status: Callable[[], Awaitable[dict[str, Any] | None]]) -> None:
        """Write ``status()`` for the page every :data:`PUBLISH_EVERY_S` (None: nothing yet), until cancelled."""
        failed = False
        while True:
            try:
                if (now := await status()) is not None:
                    write_snapshot(self.snapshot, now)
                failed = False
            except OSError as err:
                if not failed:  # once per failure, not four times a second
                    log.warning("status page: cannot write its snapshot to %s (%s)", self.snapshot, err)
                failed = True
            await asyncio.sleep(PUBLISH_EVERY_S)

    def close(self) -> None:
        """Stop the page process (its input closes) and remove the snapshot."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def write_snapshot(path: Path, status: dict[str, Any]) -> None:
    """``status`` and the time it was taken (the system's monotonic clock, shared by every process)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"published": time.monotonic(), "status": status}))
    os.replace(tmp, path)


def read_snapshot(path: Path) -> dict[str, Any]:
    """The last status written to ``path``, with ``age_s``: how long ago the synchronizer wrote it."""
    snap = json.loads(path.read_text())
    return {**snap["status"], "age_s": round(time.monotonic() - snap["published"], 3)}


def _memory_folder() -> str | None:
    """``/dev/shm`` where there is one (a snapshot never touches a disk), else the default temporary folder."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def _read_line(stream: Any, timeout_s: float) -> str:
    """One line from the page process, or "" if it says nothing within ``timeout_s`` or exits."""
    ready, _, _ = select.select([stream], [], [], timeout_s)
    return stream.readline() if ready else ""


def main(argv: list[str]) -> int:
    """The page process: bind, say the port on stdout, serve until stdin closes."""
    from ddiloco.runtime.status.page import StatusPage  # here, so the synchronizer never imports http.server

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C in the terminal stops the synchronizer, which stops this
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s ddiloco.status-page %(levelname)s %(message)s")
    host, port, folder = argv[0], int(argv[1]), Path(argv[2])
    token = json.loads(sys.stdin.readline())["token"]
    try:
        page = StatusPage(Address(host, port), token)
    except ConfigError as err:
        print(json.dumps({"error": str(err)}), flush=True)
        return 2
    page.attach(lambda: read_snapshot(folder / SNAPSHOT))
    page.start()
    print(json.dumps({"port": page.port, "url": page.url}), flush=True)
    sys.stdin.read()  # returns when the synchronizer closes our input or exits, however it exits
    page.close()
    shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
