"""Starting a learner's link helper (``helper.py``) from its training process, and ending it.

The helper is a fresh interpreter (``subprocess``: the training process holds torch's and
possibly gRPC's threads, and a forked copy of them is not safe), given one end of a socket
pair and the slots' shared file as inherited descriptors. It answers READY once it has mapped
the slots and made its clients, or FATAL with one line; a helper that exits or stays silent
instead is reported in one line too, never waited for without end.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import ddiloco
from ddiloco.core.shared.errors import DdilocoError
from ddiloco.runtime.learner.helper_wire import HelperSpec, Msg, Pipe, PipeClosed

HELPER_COMMAND = [sys.executable, "-m", "ddiloco.runtime.learner.helper"]
"""The helper's command line, before its two descriptors."""
START_S = 120.0
"""The longest a helper may take to answer READY (it imports torch and gRPC: seconds on a loaded host)."""


class HelperError(DdilocoError):
    """The learner's link helper could not start (one line: why)."""


class HelperProcess:
    """One running helper: its process and the training process's end of the socket pair."""

    def __init__(self, proc: subprocess.Popen, pipe: Pipe) -> None:
        self.proc = proc
        self.pipe = pipe

    @classmethod
    def start(cls, spec: HelperSpec, slots_fd: int) -> "HelperProcess":
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        src = str(Path(ddiloco.__file__).resolve().parent.parent)  # the helper imports this very ddiloco
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
        try:
            proc = subprocess.Popen(HELPER_COMMAND + [str(theirs.fileno()), str(slots_fd)], env=env,
                                    pass_fds=(theirs.fileno(), slots_fd), stdin=subprocess.DEVNULL)
        except OSError as err:
            ours.close()
            raise HelperError(f"could not start the learner's link helper ({HELPER_COMMAND[0]}): {err}") from None
        finally:
            theirs.close()
        helper = cls(proc, Pipe(ours))
        try:
            helper.pipe.send(Msg.INIT, spec)
            ours.settimeout(START_S)
            reply = helper.pipe.recv()
            ours.settimeout(None)
        except (PipeClosed, socket.timeout, EOFError) as err:
            helper.kill()
            code = proc.poll()
            raise HelperError(f"the learner's link helper (pid {proc.pid}) "
                              + (f"exited ({describe_exit(code)}) before it was ready (its stderr says why)"
                                 if code is not None else f"did not answer in {START_S:g} s ({err})")) from None
        if reply[0] is Msg.FATAL:
            helper.kill()
            raise HelperError(reply[1])
        return helper

    def messages(self) -> Iterator[tuple]:
        """What the helper reports, a message at a time (a join's state with its file's descriptor),
        until it says CLOSED or is gone."""
        while True:
            try:
                msg = self.pipe.recv()
                if msg[0] is Msg.ADMITTED:
                    msg = (*msg, self.pipe.recv_fd())
            except PipeClosed:
                return
            if msg[0] is Msg.CLOSED:
                return
            yield msg

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        """End it now (it is given no chance to say more), and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.pipe.close()

    def wait(self, timeout_s: float) -> None:
        """Let it exit on its own for ``timeout_s``, then kill it."""
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        self.kill()

    def exit_line(self) -> str:
        try:
            code = self.proc.wait(5.0)
        except subprocess.TimeoutExpired:
            return "stopped answering"
        return describe_exit(code)


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
