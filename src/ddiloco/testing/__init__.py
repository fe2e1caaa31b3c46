"""The harness that the tests and the benchmarks share, as ``torch.testing`` is torch's: a free port,
a wait with a deadline, the ``ddiloco sync`` and ``ddiloco learner`` command lines, child processes
that are always cleaned up, and a synchronizer or a learner inside the calling process.

Nothing else in :mod:`ddiloco` imports this package (the layers contract in ``pyproject.toml``).

============================  =====================================================================
module                        what it holds
============================  =====================================================================
:mod:`.waiting`               :data:`DEADLINE_S`, :func:`wait_for`, :func:`port_from_file`
:mod:`.commands`              :func:`sync_argv` (the launchers' ``SyncLine``), :func:`sync_args`,
                              :func:`learner_args`, :func:`ddiloco_argv`
:mod:`.subprocesses`          :class:`Procs`, :class:`SyncProcess`, sessions (:func:`ddiloco_session`,
                              :func:`session_pids`, :func:`finish`, :func:`stop_session`),
                              :func:`netns_unavailable`
:mod:`.in_process`            :class:`InProcessSync`, :class:`Honest`, :func:`train_steps`,
                              :func:`train_until_updates`, :func:`status_of`, :func:`versions`
============================  =====================================================================
"""

from ddiloco.runtime.launch.local_run import free_port
from ddiloco.testing.commands import ddiloco_argv, learner_args, sync_args, sync_argv
from ddiloco.testing.in_process import Honest, InProcessSync, status_of, train_steps, train_until_updates, versions
from ddiloco.testing.subprocesses import (
    Procs,
    SyncProcess,
    ddiloco_session,
    finish,
    netns_unavailable,
    process_state,
    session_pids,
    stop_session,
    wait_until_running,
)
from ddiloco.testing.waiting import DEADLINE_S, port_from_file, wait_for

__all__ = [
    "DEADLINE_S", "Honest", "InProcessSync", "Procs", "SyncProcess", "ddiloco_argv", "ddiloco_session", "finish",
    "free_port", "learner_args", "netns_unavailable", "port_from_file", "process_state", "session_pids", "status_of",
    "stop_session", "sync_args", "sync_argv", "train_steps", "train_until_updates", "versions", "wait_for",
    "wait_until_running",
]
