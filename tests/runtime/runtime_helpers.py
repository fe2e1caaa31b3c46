"""Helpers for runtime tests: free ports, child processes, polling, an in-process synchronizer, and every
process of a session (to prove none is left behind)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from ddiloco.runtime.client import CallRefused, SyncClient, Unreachable


def netns_unavailable() -> str:
    """Why this machine cannot run ``--hosts netns`` (not root, no ``ip netns``), or "" where it can."""
    from ddiloco.core.shared.errors import ConfigError
    from ddiloco.runtime.launch.netns import check_available

    try:
        check_available()
    except ConfigError as err:
        return str(err)
    return ""


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


def ddiloco_session(*args: str, out: Path | None = None) -> subprocess.Popen:
    """``ddiloco ARGS`` as a session leader (every process it starts shares its session id), output piped."""
    return subprocess.Popen([sys.executable, "-m", "ddiloco.cli", *args, *(["--out", str(out)] if out else [])],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


DEADLINE_S = 90.0
"""Generous bound for anything a test waits for: on a loaded 2-core machine, never a timing claim."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate: Callable[[], Any], what: str, timeout_s: float = DEADLINE_S, poll_s: float = 0.1) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail naming ``what`` at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(poll_s)


def train_steps(runtime: Any, workload: Any, model: Any, index: int, steps: int,
                until: Callable[[], bool] | None = None, deadline_s: float = 60.0) -> Any:
    """``steps`` inner steps of ``model`` on learner ``index``'s shard, each handed to ``runtime``,
    then, with ``until``, more steps until it holds (an update lands on the training thread, inside
    ``runtime.step``, so waiting for one means training on) or ``deadline_s`` passes; returns the
    trainer (its optimizer state is the learner's)."""
    trainer, sampler = workload.new_trainer(model), workload.sampler(index)
    deadline = time.monotonic() + deadline_s
    done = 0
    while done < steps or (until is not None and not until() and time.monotonic() < deadline):
        x, y = sampler.next_batch()
        trainer.step(x, y)
        runtime.step(tokens=x.numel())
        done += 1
    return trainer


def status_of(port: int, token: str | None = None) -> dict | None:
    """The synchronizer's status, or None while it is unreachable."""
    try:
        with SyncClient(f"127.0.0.1:{port}", token=token) as client:
            return client.status_dict(timeout_s=5.0)
    except (Unreachable, CallRefused):
        return None


class Procs:
    """Child ``ddiloco`` processes of one test, each logging to its own file."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "ab")
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        proc = subprocess.Popen([sys.executable, "-m", "ddiloco.cli", *args], stdout=log, stderr=subprocess.STDOUT,
                                env=full_env)
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


def sync_args(port: int, *extra: str, learners: int = 2) -> list[str]:
    """A tiny-preset synchronizer with short leases, for tests."""
    return ["sync", "--preset", "tiny", "--learners", str(learners), "--listen", f"127.0.0.1:{port}",
            "--set", "protocol.lease_s=2.0", "--set", "protocol.heartbeat_s=0.3", "--log-level", "info", *extra]


def learner_args(port: int, name: str, *extra: str) -> list[str]:
    return ["learner", "--connect", f"127.0.0.1:{port}", "--id", name, "--threads", "1", *extra]


class InProcessSync:
    """A :class:`SyncService` on its own event-loop thread inside the test process."""

    def __init__(self, config: Any, options: Any, *, listen: Any = None, credentials: Any = None,
                 layout: Any = None) -> None:
        import asyncio
        import threading

        from ddiloco.runtime.auth import Address
        from ddiloco.runtime.sync.server import SyncServer
        from ddiloco.runtime.sync.service import SyncService

        self.service = SyncService(config, options, layout=layout)
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        async def main() -> None:
            self.server = SyncServer(self.service)
            self.port = await self.server.start(listen or Address("127.0.0.1", 0), credentials)
            started.set()
            await self.server.closing.wait()
            await self.server.stop()

        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(main(),), daemon=True)
        self.thread.start()
        assert started.wait(30), "in-process synchronizer did not start"

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the service's event loop (awaiting it if it is a coroutine function)."""
        import asyncio

        async def run() -> Any:
            result = fn()
            return await result if asyncio.iscoroutine(result) else result

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(30)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.server.closing.set)
        self.thread.join(30)


class Honest:
    """A learner training the reference workload in a thread, as a user's loop would."""

    def __init__(self, config: Any, port: int, name: str, index: int, **credentials: str) -> None:
        from ddiloco.runtime.learner.runtime import LearnerRuntime
        from ddiloco.workload.workload import Workload

        self.workload = Workload.build(config)
        self.model = self.workload.new_model()
        self.runtime = LearnerRuntime(self.model, f"127.0.0.1:{port}", name,
                                      tokens_per_step=self.workload.tokens_per_step, **credentials)
        self.index = index
        self.error: Exception | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._train, daemon=True)
        self.thread.start()

    def _train(self) -> None:
        trainer = self.workload.new_trainer(self.model)
        sampler = self.workload.sampler(self.index)
        try:
            while not self.stop.is_set() and not self.runtime.should_stop:
                x, y = sampler.next_batch()
                trainer.step(x, y)
                self.runtime.step(tokens=x.numel())
        except Exception as err:  # what a user's loop would see: the test reads it from ``error``
            self.error = err

    def close(self) -> None:
        self.stop.set()
        self.thread.join(60)
        self.runtime.close()


def versions(client: SyncClient) -> list[int]:
    """Every fragment's version, as the synchronizer's status says."""
    return [f["version"] for f in client.status_dict()["fragments"]]


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


def join_flood(address: str, joins: int, *, at_once: int = 8, token: str | None = None,
               started: threading.Event | None = None) -> dict[str, int]:
    """``joins`` Join calls under distinct ids, ``at_once`` at a time, each cancelled after its first
    reply (a member holding the run's token that abandons every join): what each call ended with,
    counted. ``started`` is set once a tenth of them have been made."""
    import asyncio
    import collections

    import grpc

    from ddiloco.runtime.auth import client_metadata
    from ddiloco.runtime.proto import ddiloco_pb2 as pb
    from ddiloco.runtime.sync.service import SERVICE_NAME

    ended: collections.Counter[str] = collections.Counter()
    metadata = client_metadata(token)

    async def flood() -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            join = channel.unary_stream(f"/{SERVICE_NAME}/Join", request_serializer=lambda b: b,
                                        response_deserializer=lambda b: b)
            gate = asyncio.Semaphore(at_once)

            async def one(i: int) -> None:
                async with gate:
                    call = join(pb.JoinRequest(learner_id=f"flood-{i}", boot=f"f{i}").SerializeToString(),
                                timeout=DEADLINE_S, metadata=metadata)
                    try:
                        async for _ in call:
                            call.cancel()
                            break
                        ended["abandoned"] += 1
                    except grpc.aio.AioRpcError as err:
                        ended[err.details().split(":")[0]] += 1
                    except asyncio.CancelledError:
                        ended["abandoned"] += 1
                    if started is not None and sum(ended.values()) >= joins // 10:
                        started.set()

            await asyncio.gather(*(one(i) for i in range(joins)))

    asyncio.run(flood())
    return dict(ended)
