"""``python -m ddiloco.runtime.launch.child PARENT MODULE ARGS...``: run MODULE as ``__main__``, killed with its parent.

``PARENT --exec COMMAND ARGS...`` runs any command the same way (the kernel's request is kept
across ``execve``): ``ddiloco launch`` starts the user's own script so.

Every child of a local run starts through this module (:class:`ddiloco.runtime.launch.processes.Processes`).
It asks the kernel for SIGKILL when its parent dies (``prctl(PR_SET_PDEATHSIG)``), checks
that the parent it was started by is still the one it has (if not, the parent died before
the request took effect), then runs the real entry point. Doing this in the child rather
than in a ``preexec_fn`` keeps the launcher's ``fork`` cheap and safe: a ``preexec_fn``
forces a full ``fork`` of a process that holds gRPC's threads, whose fork handlers can
abort the child before it ever runs.
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys

PR_SET_PDEATHSIG = 1
EXEC = "--exec"
"""In place of MODULE: run the command that follows (``execvp``) instead of a Python module."""


def main() -> None:
    parent, module = int(sys.argv[1]), sys.argv[2]
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:
        sys.exit(f"{module}: the process that started it ({parent}) is gone")
    if module == EXEC:  # a command of the user's (``ddiloco launch``): the request survives exec
        try:
            os.execvp(sys.argv[3], sys.argv[3:])
        except OSError as err:
            sys.exit(f"cannot run {sys.argv[3]!r}: {err.strerror}")
    sys.argv = [module, *sys.argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
