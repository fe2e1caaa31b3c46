"""The pieces of a run on one machine, shared by :func:`~ddiloco.runtime.launch.launcher.run_processes`,
real data parallel (:mod:`~ddiloco.baseline.data_parallel`), ``ddiloco chaos`` and ``ddiloco launch``
(:mod:`~ddiloco.runtime.launch.supervise`): the run's files, the synchronizer's command line per
shard, its port once bound, the learners' threads, and the evaluator of the global model.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ddiloco.core.shared.errors import DdilocoError
from ddiloco.core.shared.fragments import unflatten_into
from ddiloco.outputs.reporting import write_config
from ddiloco.runtime.launch.command_lines import SyncLine
from ddiloco.runtime.launch.netns import SYNC_HOST
from ddiloco.runtime.launch.placement import Placement, sync_names
from ddiloco.runtime.launch.processes import Processes, StopSignals
from ddiloco.runtime.layout import reference_layout
from ddiloco.runtime.sharded import ShardedClient
from ddiloco.settings.config import Config
from ddiloco.workload.workload import Workload

POLL_S = 0.25
START_TIMEOUT_S = 120.0
LEAVE_TIMEOUT_S = 30.0
"""How long learners told to stop (or told the run is over) may take to flush and leave."""
NETNS_HTTP_PORT = 8080


@dataclass(frozen=True)
class RunFiles:
    """What a local run takes from its configuration before anything starts: where it keeps its
    configuration, logs, port files and checkpoints, and its learners' names and torch threads."""

    out: Path
    logs: Path
    config_file: Path
    port_files: list[Path]
    state_dirs: list[Path]
    learners: list[str]
    threads: int
    """Torch threads per learner (:func:`learner_threads`)."""

    @property
    def sync_names(self) -> list[str]:
        """``sync``, or ``sync-<i>`` per shard: the children's and the logs' names."""
        return sync_names(len(self.port_files))


def prepare_files(config: Config, out: Path) -> RunFiles:
    """Create ``out`` and ``out/logs``, write the configuration; forget the logs, ports and checkpoints of a
    previous run."""
    logs = fresh_logs(out)
    config_file = out / "runtime-config.toml"
    write_config(config_file, config)
    names = sync_names(config.protocol.shards)
    files = RunFiles(out, logs, config_file, [out / f"{name}.port" for name in names],
                     state_dirs(out, config.protocol.shards), learner_names(config.run.learners),
                     learner_threads(config.run.learners))
    for port_file, state_dir in zip(files.port_files, files.state_dirs):
        port_file.unlink(missing_ok=True)
        (state_dir / "synchronizer.safetensors").unlink(missing_ok=True)
    return files


def fresh_logs(out: Path) -> Path:
    """``out/logs``, made if missing, without the logs of a previous run (a restarted child appends to its own)."""
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for old in logs.glob("*.log"):
        old.unlink()
    return logs


def state_dirs(out: Path, shards: int) -> list[Path]:
    """Each synchronizer's --state-dir in a run's directory: ``sync-state``, or ``sync-state-<i>`` per shard."""
    return [out / name.replace(SYNC_HOST, "sync-state", 1) for name in sync_names(shards)]


def learner_names(learners: int) -> list[str]:
    return [f"learner-{i}" for i in range(learners)]


def learner_threads(learners: int) -> int:
    """Torch threads per learner: the cores shared by the learners and the synchronizer."""
    return max(1, (os.cpu_count() or 1) // (learners + 1))


def free_port() -> int:
    """A port free right now on 127.0.0.1 (for the status page, whose port must survive restarts;
    in a network namespace every port is free: :data:`NETNS_HTTP_PORT`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def announce(text: str) -> None:
    """One line for the user on stderr (above a progress bar, which redirects it)."""
    print(text, file=sys.stderr, flush=True)


class GlobalEvaluator:
    """Evaluates the synchronizer's current global model on the workload's held-out data."""

    def __init__(self, config: Config, client: ShardedClient) -> None:
        self.workload = Workload.build(config)
        self.model = self.workload.new_model()
        self.plan = reference_layout(config, config.protocol.for_mode(config.run.mode, config.run.learners)).plan
        self.client = client

    def evaluate(self, *, wait_for_ready: bool = False) -> tuple[float, list[int]]:
        """(eval loss, fragment versions) of the global model as the synchronizer holds it now.
        ``wait_for_ready``: every synchronizer is known to be up, a failed connection attempt is tried again."""
        state = self.client.fetch_state(wait_for_ready=wait_for_ready)
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for f in self.plan.fragments:
                unflatten_into(state.fragments[f.index].values, [params[n] for n in f.param_names])
        return self.workload.evaluate(self.model), [f.version for f in state.fragments]


class StartFailed(DdilocoError):
    """A synchronizer exited before it wrote its port: its own error is the last lines of its log."""


def wait_for_port(port_file: Path, procs: Processes, name: str, stop: StopSignals | None = None) -> int:
    """The port the synchronizer ``name`` bound, once it has written ``port_file``; fails if it exits first."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if stop is not None and stop.requested is not None:
            raise KeyboardInterrupt  # nothing to stop cleanly yet
        if port_file.exists():
            text = port_file.read_text().strip()
            if text:
                return int(text)
        if procs.children[name].poll() is not None:
            raise StartFailed(f"the synchronizer {name} failed to start:\n" + procs.tail(name))
        time.sleep(0.05)
    raise DdilocoError(f"the synchronizer {name} did not start within {START_TIMEOUT_S:.0f}s:\n" + procs.tail(name))


def _page_port(line: SyncLine, shard: int, place: Placement, pages: bool) -> int | None:
    """Shard ``shard``'s status page: the one its line names; else, with ``pages``, a free port (a
    fixed one in a network namespace, where the host cannot ask for a free one); else none."""
    if line.http_port is not None or not pages:
        return line.http_port
    return free_port() if place.net is None else NETNS_HTTP_PORT + shard


class Synchronizers:
    """A run's synchronizer processes, one per shard, each started from its :class:`SyncLine` on its
    host of the placement, with the placement's token and a status page: started and restarted
    alike by ``ddiloco run --runtime processes``, ``ddiloco chaos`` and ``ddiloco launch``. A
    restart resumes its state and binds the port its learners already know."""

    def __init__(self, lines: list[SyncLine], place: Placement, procs: Processes, *, pages: bool = True) -> None:
        """``lines[i]``: shard i's command line, less where it listens; ``pages``: give a shard whose
        line names no status page one (a free port, or a fixed one in a network namespace)."""
        self.lines, self.place, self.procs = lines, place, procs
        self.names = sync_names(len(lines))
        if missing := [name for name, line in zip(self.names, lines) if line.port_file is None]:
            raise DdilocoError(f"{missing[0]}'s command line names no --port-file to read its port from")
        self.port_files: list[Path] = [line.port_file for line in lines]
        self.http_ports = [_page_port(line, i, place, pages) for i, line in enumerate(lines)]
        self.ports: list[int] = []
        """Each shard's gRPC port, once :meth:`start_all` has read them."""

    @classmethod
    def of_run(cls, files: RunFiles, place: Placement, procs: Processes, *, pages: bool = True) -> "Synchronizers":
        """The synchronizers of the run in ``files``: its configuration, a state directory and a port file each."""
        shards = len(files.port_files)
        return cls([SyncLine(config=files.config_file, shard=None if shards == 1 else (i, shards),
                             port_file=files.port_files[i], state_dir=files.state_dirs[i]) for i in range(shards)],
                   place, procs, pages=pages)

    def start(self, shard: int, *, resume: bool = False) -> None:
        """Start shard ``shard``; a restart (``resume``) binds the port it had."""
        line = self.lines[shard]
        self.port_files[shard].unlink(missing_ok=True)
        host, port = self.place.sync_listen(shard)
        words = replace(line, listen=f"{host}:{self.ports[shard] if resume else port}",
                        http_port=self.http_ports[shard], resume=resume or line.resume,
                        token_file=self.place.token_file or line.token_file).words()
        self.procs.start(self.names[shard], words, env={"OMP_NUM_THREADS": "1"}, prefix=self.place.prefix(SYNC_HOST))

    def start_all(self, stop: StopSignals | None = None) -> list[str]:
        """Start every shard; their addresses once each has written the port it listens on."""
        for shard in range(len(self.names)):
            self.start(shard)
        self.ports = [wait_for_port(pf, self.procs, name, stop) for pf, name in zip(self.port_files, self.names)]
        return [self.address(shard) for shard in range(len(self.names))]

    def address(self, shard: int) -> str:
        return f"{self.place.sync_listen(shard)[0]}:{self.ports[shard]}"

    def status_url(self, shard: int = 0) -> str:
        return f"http://{self.place.sync_listen(shard)[0]}:{self.http_ports[shard]}/"
