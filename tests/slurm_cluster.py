"""A real Slurm on this host, for tests: munged, slurmctld and one slurmd per emulated node.

Everything lives in a temporary directory: the munge key and socket, ``slurm.conf``, the
daemons' state, spool and logs. The nodes ``n1`` .. ``nN`` are slurmd processes on this
host (``slurmd -N NAME``), each on its own port, all reached at 127.0.0.1; they claim
``cpus`` CPUs each, whatever the host has (``SlurmdParameters=config_overrides``). The
commands (``sbatch``, ``scontrol``, ``srun`` inside a job) find this cluster through
``SLURM_CONF`` in :attr:`SingleHostSlurm.env`.

:meth:`SingleHostSlurm.start` raises :class:`SlurmUnavailable` with the reason when the
daemons are not installed (Debian: ``apt-get install slurmctld slurmd slurm-client``), when
not root (slurmd starts jobs as their owner), or when the cluster does not come up.
:meth:`SingleHostSlurm.stop` cancels what is left, waits for the jobs to end and stops
every daemon it started.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path

from ddiloco.testing import free_port, wait_for

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel", "sinfo", "srun")
START_S = 60.0


class SlurmUnavailable(Exception):
    """This host cannot run the single-host Slurm; the message says why."""


class SingleHostSlurm:
    def __init__(self, root: Path, *, nodes: int = 3, cpus: int = 4) -> None:
        self.root = root
        self.names = [f"n{i}" for i in range(1, nodes + 1)]
        self.cpus = cpus
        self.env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}
        self._daemons: list[tuple[str, subprocess.Popen]] = []

    # ---- life cycle -------------------------------------------------------------------------

    def start(self) -> None:
        missing = [d for d in DAEMONS if shutil.which(d) is None]
        if missing:
            raise SlurmUnavailable(f"Slurm or munge is not installed (no {', '.join(missing)}; "
                                   "Debian: apt-get install slurmctld slurmd slurm-client)")
        if os.geteuid() != 0:
            raise SlurmUnavailable("slurmd must run as root to start jobs")
        munge = self.root / "munge"
        for path in (self.root / "state", self.root / "spool", munge):
            path.mkdir(parents=True)
        munge.chmod(0o711)
        key = munge / "munge.key"
        subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True, capture_output=True)
        key.chmod(0o400)
        socket_path = munge / "munge.sock"
        self._spawn("munged", ["munged", "--foreground", "--force", f"--socket={socket_path}", f"--key-file={key}",
                               f"--log-file={munge / 'munged.log'}", f"--pid-file={munge / 'munged.pid'}",
                               f"--seed-file={munge / 'munged.seed'}"])
        self._write_conf(socket_path)
        self._spawn("slurmctld", ["slurmctld", "-D", "-f", self.env["SLURM_CONF"]])
        for name in self.names:
            self._spawn(f"slurmd-{name}", ["slurmd", "-D", "-N", name, "-f", self.env["SLURM_CONF"]])
        try:
            wait_for(lambda: self._idle_nodes() == len(self.names) or self._exited(), "the nodes to be idle", START_S)
        except AssertionError:
            pass
        if self._idle_nodes() != len(self.names):
            reason = f"single-host Slurm did not come up: {self._exited() or 'nodes not idle'}; {self.log_tail()}"
            self.stop()
            raise SlurmUnavailable(reason)

    def stop(self) -> None:
        """Cancel every job, wait until none is left, then stop the daemons (slurmd, slurmctld, munged)."""
        if any(name == "slurmctld" and proc.poll() is None for name, proc in self._daemons):
            subprocess.run(["scancel", "--full", "--user", "root"], env=self.env, capture_output=True)
            try:
                wait_for(lambda: not self.command("squeue", "-h").stdout.strip(), "the jobs to end", 60)
            except AssertionError:
                pass
        for _, proc in reversed(self._daemons):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _, proc in reversed(self._daemons):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._daemons.clear()

    def __enter__(self) -> "SingleHostSlurm":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- using it -----------------------------------------------------------------------------

    def command(self, *argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=60)

    def sbatch(self, script: Path, *options: str, env: dict[str, str]) -> int:
        done = subprocess.run(["sbatch", "--parsable", *options, str(script)], env={**self.env, **env},
                              capture_output=True, text=True, timeout=60)
        if done.returncode:
            raise AssertionError(f"sbatch refused the job: {done.stderr.strip()}")
        return int(done.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, ExitCode, NodeList, ...)."""
        text = self.command("scontrol", "show", "job", "-o", str(job_id)).stdout
        return dict(field.split("=", 1) for field in text.split() if "=" in field)

    def log_tail(self, lines: int = 15) -> str:
        out = []
        for log in sorted(self.root.glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"{log.name}: " + " | ".join(tail))
        return "; ".join(out)

    # ---- inside ---------------------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = (self.root / f"{name}.out").open("w")
        self._daemons.append((name, subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT)))

    def _exited(self) -> str:
        return ", ".join(f"{name} exited with code {proc.returncode}" for name, proc in self._daemons
                         if proc.poll() is not None)

    def _idle_nodes(self) -> int:
        done = self.command("sinfo", "-h", "-N", "-o", "%N %T")
        return sum(1 for line in done.stdout.splitlines() if line.split()[1:] == ["idle"]) if done.returncode == 0 else 0

    def _write_conf(self, munge_socket: Path) -> None:
        r = self.root
        nodes = "\n".join(f"NodeName={name} NodeHostname={socket.gethostname()} NodeAddr=127.0.0.1 Port={free_port()} "
                          f"CPUs={self.cpus} State=UNKNOWN" for name in self.names)
        (r / "slurm.conf").write_text(f"""ClusterName=ddiloco-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
StateSaveLocation={r / 'state'}
SlurmdSpoolDir={r / 'spool'}/%n
SlurmctldPidFile={r / 'slurmctld.pid'}
SlurmdPidFile={r / 'slurmd-%n.pid'}
SlurmctldLogFile={r / 'slurmctld.log'}
SlurmdLogFile={r / 'slurmd-%n.log'}
PlugStackConfig={r / 'plugstack.conf'}
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MinJobAge=600
KillWait=10
{nodes}
PartitionName=test Nodes={','.join(self.names)} Default=YES MaxTime=INFINITE State=UP
""")
        (r / "plugstack.conf").write_text("")
