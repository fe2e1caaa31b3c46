"""One machine, real processes: a synchronizer and M learners on localhost.

:func:`run_processes` is ``ddiloco run --runtime processes``: it starts ``ddiloco sync`` and
M ``ddiloco learner`` processes with the run's configuration, watches the synchronizer's
status, evaluates the global model at the same points of the token budget as the virtual
cluster does, and returns the same summary and metrics rows. The learners take the
synchronizer's configuration, so the model, initial weights, data shards and data order
are the virtual cluster's; only time is real (``virtual_time_s`` holds wall seconds). Each
synchronizer serves its status page (``--http-port``) and the launcher prints its address.

The pieces (the process table, the command lines, the evaluator of the global model) are
public: ``ddiloco chaos`` (:mod:`ddiloco.chaos.runner`) runs the same processes and breaks them.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ddiloco.config import Config
from ddiloco.core.fragments import unflatten_into
from ddiloco.errors import DdilocoError
from ddiloco.reporting import ProgressFn, summarize, write_config
from ddiloco.runtime.client import Refused, Unreachable
from ddiloco.runtime.sharded import ShardedClient
from ddiloco.runtime.layout import reference_layout
from ddiloco.workload.workload import Workload, weights_sha256

POLL_S = 0.25
START_TIMEOUT_S = 120.0


class Processes:
    """The children of one run; every one of them is killed on close, whatever happens.

    A name may be started again once its process has exited (a restart after a crash):
    its log file is appended to, so one file tells a learner's or synchronizer's whole story.
    ``ddiloco chaos`` kills, stops and restarts children through this table.
    """

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.children: dict[str, subprocess.Popen] = {}
        self._files: list[Any] = []

    def start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        previous = self.children.get(name)
        if previous is not None and previous.poll() is None:
            raise DdilocoError(f"{name} is still running (pid {previous.pid}): cannot start it again")
        log = open(self.logs / f"{name}.log", "ab")
        self._files.append(log)
        proc = subprocess.Popen([sys.executable, "-m", "ddiloco.cli", *args], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})})
        self.children[name] = proc
        return proc

    def running(self, name: str) -> bool:
        proc = self.children.get(name)
        return proc is not None and proc.poll() is None

    def signal(self, name: str, sig: signal.Signals) -> bool:
        """Send ``sig`` to ``name`` if it is running; SIGKILL also reaps it. Returns whether it was sent."""
        proc = self.children.get(name)
        if proc is None or proc.poll() is not None:
            return False
        proc.send_signal(sig)
        if sig is signal.SIGKILL:
            proc.wait()
        return True

    def tail(self, name: str, lines: int = 15) -> str:
        try:
            return "\n".join((self.logs / f"{name}.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, name: str, timeout_s: float = 10.0) -> None:
        proc = self.children.get(name)
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def close(self) -> None:
        for proc in self.children.values():
            if proc.poll() is None:
                proc.kill()  # SIGKILL also ends a stopped (SIGSTOP) process
                proc.wait()
        for f in self._files:
            f.close()


@dataclass(frozen=True)
class RunFiles:
    """Where one local run keeps its configuration, logs, port files and checkpoints."""

    out: Path
    logs: Path
    config_file: Path
    port_files: list[Path]
    state_dirs: list[Path]

    @property
    def sync_names(self) -> list[str]:
        """``sync``, or ``sync-<i>`` per shard: the children's and the logs' names."""
        return [f"sync{_shard_suffix(i, len(self.port_files))}" for i in range(len(self.port_files))]


def _shard_suffix(i: int, shards: int) -> str:
    return "" if shards == 1 else f"-{i}"


def prepare_files(config: Config, out: Path) -> RunFiles:
    """Create ``out`` and ``out/logs``, write the configuration; forget the ports and checkpoints of a previous run."""
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    config_file = out / "runtime-config.toml"
    write_config(config_file, config)
    shards = config.protocol.shards
    files = RunFiles(out, logs, config_file,
                     [out / f"sync{_shard_suffix(i, shards)}.port" for i in range(shards)],
                     [out / f"sync-state{_shard_suffix(i, shards)}" for i in range(shards)])
    for port_file, state_dir in zip(files.port_files, files.state_dirs):
        port_file.unlink(missing_ok=True)
        (state_dir / "synchronizer.safetensors").unlink(missing_ok=True)
    return files


def sync_command(files: RunFiles, shard: int, *, port: int = 0, http_port: int | None = None,
                 resume: bool = False) -> list[str]:
    """``ddiloco sync`` for shard ``shard`` of the run in ``files`` (port 0: any free port, read from its port file)."""
    shards = len(files.port_files)
    return ["sync", "--config", str(files.config_file), "--listen", f"127.0.0.1:{port}",
            *([] if shards == 1 else ["--shard", f"{shard}/{shards}"]),
            "--port-file", str(files.port_files[shard]), "--state-dir", str(files.state_dirs[shard]),
            *([] if http_port is None else ["--http-port", str(http_port)]),
            *(["--resume"] if resume else [])]


def learner_command(addresses: list[str], learner_id: str, threads: int, device: str,
                    min_step_s: float = 0.0) -> list[str]:
    """``ddiloco learner`` taking the synchronizer's configuration (same model, shards and data order).

    ``min_step_s`` pads every inner step (``--min-step-s``): slower hardware, or CPU left over
    for restarts when chaos runs many processes on a small machine.
    """
    return ["learner", "--connect", ",".join(addresses), "--id", learner_id, "--threads", str(threads),
            "--device", device, *(["--min-step-s", str(min_step_s)] if min_step_s else [])]


def learner_threads(learners: int) -> int:
    """Torch threads per learner: the cores shared by the learners and the synchronizer."""
    return max(1, (os.cpu_count() or 1) // (learners + 1))


def free_port() -> int:
    """A port free right now on 127.0.0.1 (for the status page, whose port must survive restarts)."""
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

    def evaluate(self) -> tuple[float, list[int]]:
        """(eval loss, fragment versions) of the global model as the synchronizer holds it now."""
        state = self.client.fetch_state()
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for f in self.plan.fragments:
                unflatten_into(state.fragments[f.index].values, [params[n] for n in f.param_names])
        return self.workload.evaluate(self.model), [f.version for f in state.fragments]


def run_processes(
    config: Config,
    out: Path,
    progress: ProgressFn | None = None,
    *,
    timeout_s: float | None = None,
    device: str = "cpu",
    min_step_s: float = 0.0,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run ``config`` as one synchronizer and M learner processes on 127.0.0.1 (learners train on ``device``,
    each inner step padded to at least ``min_step_s``).

    Writes the children's logs to ``out/logs`` and the synchronizer's checkpoints to
    ``out/sync-state`` (``sync-state-<i>`` per shard when ``protocol.shards`` > 1: one
    synchronizer process per shard); returns (summary, metrics rows) like the virtual cluster.
    """
    if config.run.mode not in ("decoupled", "diloco"):
        raise DdilocoError(f"--runtime processes runs modes decoupled and diloco, not {config.run.mode!r} "
                           "(data-parallel baselines run on the virtual cluster)")
    files = prepare_files(config, out)
    m = config.run.learners
    threads = learner_threads(m)
    started = time.monotonic()
    rows: list[dict[str, Any]] = []
    procs = Processes(files.logs)
    client: ShardedClient | None = None
    syncs = files.sync_names
    try:
        for i, name in enumerate(syncs):
            http_port = free_port()
            procs.start(name, sync_command(files, i, http_port=http_port), env={"OMP_NUM_THREADS": "1"})
            announce(f"{name}: status page at http://127.0.0.1:{http_port}/")
        addresses = [f"127.0.0.1:{wait_for_port(pf, procs, name)}" for pf, name in zip(files.port_files, syncs)]
        client = ShardedClient(addresses)
        evaluator = GlobalEvaluator(config, client)
        for i in range(m):
            procs.start(f"learner-{i}", learner_command(addresses, f"learner-{i}", threads, device, min_step_s),
                        env={"OMP_NUM_THREADS": str(threads)})

        def evaluate(status: dict[str, Any]) -> dict[str, Any]:
            eval_loss, versions = evaluator.evaluate()
            row = {
                "virtual_time_s": round(time.monotonic() - started, 3),
                "tokens": status["tokens"],
                "eval_loss": eval_loss,
                "goodput": status["goodput"],
                "uptime": status["model_uptime"],
                "bytes_up": status["bytes_up"],
                "bytes_down": status["bytes_down"],
                "fragment_versions": versions,
                "alive": sum(1 for lr in status["learners"] if lr["alive"]),
            }
            rows.append(row)
            if progress:
                progress(_fraction(config, status, time.monotonic() - started), row)
            return row

        status = client.status_dict()
        evaluate(status)
        evals_done = 1
        while True:
            if timeout_s is not None and time.monotonic() - started > timeout_s:
                raise DdilocoError(f"process run did not finish within {timeout_s:.0f}s (logs in {files.logs})")
            dead = next((name for name in syncs if not procs.running(name)), None)
            if dead is not None:
                raise DdilocoError(f"the synchronizer {dead} exited with code {procs.children[dead].returncode}:\n"
                                   + procs.tail(dead))
            try:
                status = client.status_dict()
            except (Unreachable, Refused):
                time.sleep(POLL_S)
                continue
            if status["finished"]:
                break
            learners = [p for name, p in procs.children.items() if name not in syncs]
            if all(p.poll() is not None for p in learners):
                bad = next((n for n, p in procs.children.items() if n not in syncs and p.returncode), None)
                raise DdilocoError("every learner exited before the run finished"
                                   + (f"; {bad}:\n{procs.tail(bad)}" if bad else ""))
            fraction = _fraction(config, status, time.monotonic() - started)
            if fraction >= evals_done / config.train.evals and evals_done < config.train.evals:
                evaluate(status)
                evals_done += 1
            time.sleep(POLL_S)
        final = evaluate(status)
        wall = time.monotonic() - started
        for name in list(procs.children):
            if name not in syncs:
                try:
                    procs.children[name].wait(30)
                except subprocess.TimeoutExpired:
                    procs.stop(name)
        for name in syncs:
            procs.stop(name)
    finally:
        if client is not None:
            client.close()
        procs.close()
    tokens_per_step = config.train.batch_size * config.model.seq_len
    by_id = {lr["id"]: lr for lr in status["learners"]}
    summary = summarize(
        config,
        final,
        wall_s=wall,
        runtime="processes",
        weights_sha256=weights_sha256(evaluator.model),
        fragment_versions=final["fragment_versions"],
        rounds_closed=status["quorum"]["rounds_closed"],
        rejections=status["rejections"],
        steps_per_learner=[by_id.get(f"learner-{i}", {}).get("tokens", 0) // tokens_per_step for i in range(m)],
    )
    return summary, rows


def _fraction(config: Config, status: dict[str, Any], elapsed_s: float) -> float:
    if config.run.time_s:
        return min(1.0, elapsed_s / config.run.time_s)
    return min(1.0, status["tokens"] / max(1, config.run.tokens))


def wait_for_port(port_file: Path, procs: Processes, name: str) -> int:
    """The port the synchronizer ``name`` bound, once it has written ``port_file``; fails if it exits first."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if port_file.exists():
            text = port_file.read_text().strip()
            if text:
                return int(text)
        if procs.children[name].poll() is not None:
            raise DdilocoError(f"the synchronizer {name} failed to start:\n" + procs.tail(name))
        time.sleep(0.05)
    raise DdilocoError(f"the synchronizer {name} did not start within {START_TIMEOUT_S:.0f}s:\n" + procs.tail(name))
