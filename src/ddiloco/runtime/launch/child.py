"""``python -m ddiloco.runtime.launch.child PARENT MODULE ARGS...``: run MODULE as ``__main__``, killed with its parent.

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


def main() -> None:
    parent, module = int(sys.argv[1]), sys.argv[2]
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:
        sys.exit(f"{module}: the process that started it ({parent}) is gone")
    sys.argv = [module, *sys.argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
