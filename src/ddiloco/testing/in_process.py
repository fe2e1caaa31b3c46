"""A synchronizer and a learner inside the calling process, and the synchronizer's status read back."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

from ddiloco.runtime.client import CallRefused, SyncClient, Unreachable


def status_of(port: int, token: str | None = None) -> dict | None:
    """The status of the synchronizer on 127.0.0.1:``port``, or None while it is unreachable."""
    try:
        with SyncClient(f"127.0.0.1:{port}", token=token) as client:
            return client.status_dict(timeout_s=5.0)
    except (Unreachable, CallRefused):
        return None


def versions(client: SyncClient) -> list[int]:
    """Every fragment's version, as the synchronizer's status says."""
    return [f["version"] for f in client.status_dict()["fragments"]]


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


def train_until_updates(runtime: Any, workload: Any, model: Any, updates: int, deadline_s: float = 90.0) -> None:
    """Learner 0's steps for two periods, then until ``updates`` updates have landed (or ``deadline_s``
    passes); the runtime is closed whatever happens, so its helper never outlives the test."""
    try:
        train_steps(runtime, workload, model, 0, 2 * runtime.plan.period, deadline_s=deadline_s,
                    until=lambda: runtime.stats.updates_applied >= updates)
    finally:
        runtime.close()


class InProcessSync:
    """A :class:`~ddiloco.runtime.sync.service.SyncService` on its own event-loop thread inside the
    calling process."""

    def __init__(self, config: Any, options: Any, *, listen: Any = None, credentials: Any = None,
                 layout: Any = None) -> None:
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

        async def run() -> Any:
            result = fn()
            return await result if asyncio.iscoroutine(result) else result

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(30)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.server.closing.set)
        self.thread.join(30)


class Honest:
    """A learner training the reference workload in a thread, as a user's loop would, each inner step
    padded to :attr:`STEP_S`: the tests watch the service, and a learner spinning on the tiny model's
    2 ms steps takes the cores (and the GIL, in process) from the service it shares them with."""

    STEP_S = 0.02

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
            started = 0.0
            while not self.stop.is_set() and not self.runtime.should_stop:
                # The pad before the step, not after: a failure that comes meanwhile is raised by the step.
                self.stop.wait(self.STEP_S - (time.perf_counter() - started))
                started = time.perf_counter()
                x, y = sampler.next_batch()
                trainer.step(x, y)
                self.runtime.step(tokens=x.numel())
        except Exception as err:  # what a user's loop would see: the test reads it from ``error``
            self.error = err

    def close(self) -> None:
        self.stop.set()
        self.thread.join(60)
        self.runtime.close()
