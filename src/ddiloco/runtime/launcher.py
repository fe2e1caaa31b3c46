"""One machine, real processes: a synchronizer and M learners on localhost.

:func:`run_processes` is ``ddiloco run --runtime processes``: it starts ``ddiloco sync`` and
M ``ddiloco learner`` processes with the run's configuration, watches the synchronizer's
status, evaluates the global model at the same points of the token budget as the virtual
cluster does, and returns the same summary and metrics rows. The learners take the
synchronizer's configuration, so the model, initial weights, data shards and data order
are the virtual cluster's; only time is real (``virtual_time_s`` holds wall seconds).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
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


class _Processes:
    """The children of one run; every one of them is terminated on exit, whatever happens."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.children: dict[str, subprocess.Popen] = {}
        self._files: list[Any] = []

    def start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "ab")
        self._files.append(log)
        proc = subprocess.Popen([sys.executable, "-m", "ddiloco.cli", *args], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})})
        self.children[name] = proc
        return proc

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
                proc.kill()
                proc.wait()
        for f in self._files:
            f.close()


def run_processes(
    config: Config,
    out: Path,
    progress: ProgressFn | None = None,
    *,
    timeout_s: float | None = None,
    device: str = "cpu",
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run ``config`` as one synchronizer and M learner processes on 127.0.0.1 (learners train on ``device``).

    Writes the children's logs to ``out/logs`` and the synchronizer's checkpoints to
    ``out/sync-state`` (``sync-state-<i>`` per shard when ``protocol.shards`` > 1: one
    synchronizer process per shard); returns (summary, metrics rows) like the virtual cluster.
    """
    if config.run.mode not in ("decoupled", "diloco"):
        raise DdilocoError(f"--runtime processes runs modes decoupled and diloco, not {config.run.mode!r} "
                           "(data-parallel baselines run on the virtual cluster)")
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    config_file = out / "runtime-config.toml"
    write_config(config_file, config)
    shards = config.protocol.shards
    suffix = (lambda i: "") if shards == 1 else (lambda i: f"-{i}")
    port_files = [out / f"sync{suffix(i)}.port" for i in range(shards)]
    state_dirs = [out / f"sync-state{suffix(i)}" for i in range(shards)]
    for port_file, state_dir in zip(port_files, state_dirs):
        port_file.unlink(missing_ok=True)
        (state_dir / "synchronizer.safetensors").unlink(missing_ok=True)

    workload = Workload.build(config)
    protocol = config.protocol.for_mode(config.run.mode, config.run.learners)
    plan = reference_layout(config, protocol).plan
    eval_model = workload.new_model()
    m = config.run.learners
    threads = max(1, (os.cpu_count() or 1) // (m + 1))
    started = time.monotonic()
    rows: list[dict[str, Any]] = []
    procs = _Processes(logs)
    client: ShardedClient | None = None
    syncs = [f"sync{suffix(i)}" for i in range(shards)]
    try:
        for i, name in enumerate(syncs):
            shard = [] if shards == 1 else ["--shard", f"{i}/{shards}"]
            procs.start(name, ["sync", "--config", str(config_file), "--listen", "127.0.0.1:0", *shard,
                               "--port-file", str(port_files[i]), "--state-dir", str(state_dirs[i])],
                        env={"OMP_NUM_THREADS": "1"})
        addresses = [f"127.0.0.1:{_wait_for_port(pf, procs, name)}" for pf, name in zip(port_files, syncs)]
        client = ShardedClient(addresses)
        for i in range(m):
            procs.start(f"learner-{i}", ["learner", "--connect", ",".join(addresses), "--id", f"learner-{i}",
                                         "--threads", str(threads), "--device", device],
                        env={"OMP_NUM_THREADS": str(threads)})

        def evaluate(status: dict[str, Any]) -> dict[str, Any]:
            state = client.fetch_state()
            params = dict(eval_model.named_parameters())
            with torch.no_grad():
                for f in plan.fragments:
                    unflatten_into(state.fragments[f.index].values, [params[n] for n in f.param_names])
            row = {
                "virtual_time_s": round(time.monotonic() - started, 3),
                "tokens": status["tokens"],
                "eval_loss": workload.evaluate(eval_model),
                "goodput": status["goodput"],
                "uptime": status["model_uptime"],
                "bytes_up": status["bytes_up"],
                "bytes_down": status["bytes_down"],
                "fragment_versions": [f.version for f in state.fragments],
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
                raise DdilocoError(f"process run did not finish within {timeout_s:.0f}s (logs in {logs})")
            dead = next((name for name in syncs if procs.children[name].poll() is not None), None)
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
        weights_sha256=weights_sha256(eval_model),
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


def _wait_for_port(port_file: Path, procs: _Processes, name: str) -> int:
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
