"""Child ``ddiloco`` processes of a test or a benchmark, and every process of a session (to prove
none is left behind)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from ddiloco.testing.commands import ddiloco_argv, sync_argv
from ddiloco.testing.in_process import status_of
from ddiloco.testing.waiting import DEADLINE_S, port_from_file, wait_for


class Procs:
    """Child ``ddiloco`` processes, each logging to its own file in ``logs``."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "ab")
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        proc = subprocess.Popen(ddiloco_argv(*args), stdout=log, stderr=subprocess.STDOUT, env=full_env)
        log.close()
        self.procs[name] = proc
        return proc

    def kill9(self, name: str) -> None:
        proc = self.procs[name]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


class SyncProcess:
    """``ddiloco sync`` (:func:`~ddiloco.testing.commands.sync_argv` of ``extra`` and ``options``) as a
    child process logging to ``log``, returned once it listens: its port read from ``port_file``.
    Leaving a ``with`` block kills it; :meth:`stop` asks it to stop as an operator would."""

    def __init__(self, port_file: Path, log: Path, *extra: str, env: dict[str, str] | None = None,
                 timeout_s: float = DEADLINE_S, **options) -> None:
        port_file.unlink(missing_ok=True)  # a port file of an earlier start must not be read
        self.log = log
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(ddiloco_argv(*sync_argv(*extra, port_file=port_file, **options)),
                                         stdout=out, stderr=subprocess.STDOUT,
                                         env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
        try:
            self.port = port_from_file(port_file, self.proc, log, timeout_s)
        except BaseException:
            self.kill()
            raise
        self.address = f"127.0.0.1:{self.port}"

    def stop(self, timeout_s: float = DEADLINE_S) -> int:
        """SIGTERM, then its exit code (killed if it does not stop within ``timeout_s``)."""
        self.proc.terminate()
        try:
            return self.proc.wait(timeout=timeout_s)
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def __enter__(self) -> SyncProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


def ddiloco_session(*args: str, out: Path | None = None) -> subprocess.Popen:
    """``ddiloco ARGS`` as a session leader (every process it starts shares its session id), output piped."""
    return subprocess.Popen(ddiloco_argv(*args, *(["--out", str(out)] if out else [])), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def wait_until_running(proc: subprocess.Popen, out: Path) -> set[int]:
    """A local run of ``proc`` writing into ``out``, once a learner has joined its synchronizer and it has
    at least three children (the synchronizer and two learners); returns their pids."""
    port = int(wait_for(lambda: (out / "sync.port").exists() and (out / "sync.port").read_text().strip(),
                        "the synchronizer's port file", timeout_s=180))
    wait_for(lambda: (s := status_of(port)) and any(lr["alive"] for lr in s["learners"]), "a learner to join",
             timeout_s=180)
    return wait_for(lambda: (p := session_pids(proc.pid) - {proc.pid}) and len(p) >= 3 and p,
                    "the synchronizer and both learners", timeout_s=180)


def stop_session(proc: subprocess.Popen, sig: signal.Signals, timeout_s: float = 180) -> tuple[str, str]:
    """Send ``sig`` to the session leader ``proc`` and wait for it to exit; (stdout, stderr). Whatever
    happens, nothing of its session is left running."""
    try:
        os.kill(proc.pid, sig)
        return proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def finish(proc: subprocess.Popen, timeout_s: float = 240) -> tuple[str, str]:
    """Wait for the session leader ``proc`` to end by itself; (stdout, stderr). Whatever happens,
    nothing of its session is left running."""
    try:
        return proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def session_pids(session: int) -> set[int]:
    """Live processes whose session id is ``session`` (a child started with start_new_session leads one)."""
    pids = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue  # exited while we looked
        fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) "
        state, sid = fields[0], int(fields[3])
        if sid == session and state != "Z":
            pids.add(int(stat.parent.name))
    return pids - {os.getpid()}


def process_state(pid: int) -> str:
    """The one-letter state of ``pid`` (R, S, T for stopped, ...), or "" once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return text[text.rindex(")") + 2]


def netns_unavailable() -> str:
    """Why this machine cannot run ``--hosts netns`` (not root, no ``ip netns``), or "" where it can."""
    from ddiloco.core.shared.errors import ConfigError
    from ddiloco.runtime.launch.netns import check_available

    try:
        check_available()
    except ConfigError as err:
        return str(err)
    return ""
