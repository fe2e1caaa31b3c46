"""Synchronous data-parallel baselines on the virtual cluster, with the same failure trace.

Every step, the live replicas each compute a gradient on their own shard and all-reduce it:
mathematically one AdamW step on the concatenation of their batches, which is how it is
computed here (one model, one batch of M·B sequences — same numbers, less CPU). A step
lasts as long as its slowest replica plus a ring all-reduce of bf16 gradients.

- ``dp`` (non-elastic): any failure stops the job; once every replica is back it restarts
  (``faults.restart_s``) from the last checkpoint, losing the steps since.
- ``dp-elastic``: a failure costs the step in flight and a reconfiguration pause
  (``faults.reconfigure_s``); the job goes on with fewer replicas, and pauses again to
  re-admit a replica when it returns.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from ddiloco.measures.wire_bytes import Direction, all_reduce_bytes
from ddiloco.sim.harness import Recorder
from ddiloco.sim.network import HEADER_BYTES
from ddiloco.sim.timeline import Happening, Rollback, RunEvents, Timeline
from ddiloco.workload.workload import Workload, weights_sha256


class DataParallel:
    def __init__(self, workload: Workload, recorder: Recorder, *, elastic: bool) -> None:
        self.config = workload.config
        self.workload = workload
        self.recorder = recorder
        self.elastic = elastic
        self.model = workload.new_model()
        self.trainer = workload.new_trainer(self.model)
        self.replicas = self.config.run.learners
        self.samplers = [workload.sampler(r) for r in range(self.replicas)]
        self.numel = sum(p.numel() for p in self.model.parameters())
        self.now = 0.0
        self.tokens = 0
        self.committed_steps = 0
        self.restarts = 0
        self.reconfigurations = 0
        self._steps = [0] * self.replicas
        self._uncommitted: list[tuple[int, int]] = []  # (replica, step) awaiting a checkpoint
        self._checkpoint = self._snapshot()
        self.timeline = Timeline()
        """Its steps (the model advancing), restarts from a checkpoint and, at the end, its replicas' outages."""

    # ---- time ----------------------------------------------------------------------------

    def _down(self, r: int, t: float) -> bool:
        return self.recorder.trace.outage_at(r, t) is not None

    def _allreduce_s(self, live: int) -> float:
        if live < 2:
            return 0.0
        c = self.config.cluster
        per_replica = all_reduce_bytes(self.numel, live)
        return 8 * per_replica / c.bandwidth_bps + 2 * (live - 1) * c.latency_s

    def _budget_spent(self) -> bool:
        run = self.config.run
        if run.time_s:
            return self.now >= run.time_s
        return self.tokens >= run.tokens

    # ---- checkpoints (non-elastic) -------------------------------------------------------

    def _snapshot(self) -> dict[str, Any]:
        return {
            "model": copy.deepcopy(self.model.state_dict()),
            "optimizer": copy.deepcopy(self.trainer.optimizer.state_dict()),
            "trainer_steps": self.trainer.steps,
            "committed_steps": self.committed_steps,
            "at_s": self.now,
        }

    def _commit(self) -> None:
        for r, step in self._uncommitted:
            self.recorder.accounting.credit(r, step, step, 1.0)
        self._uncommitted.clear()

    def _restore(self) -> None:
        snap = self._checkpoint
        self.model.load_state_dict(snap["model"])
        self.trainer.optimizer.load_state_dict(snap["optimizer"])
        self.trainer.steps = snap["trainer_steps"]
        self.committed_steps = snap["committed_steps"]
        self._uncommitted.clear()  # the work since the checkpoint is lost

    # ---- the run -------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        self._evaluate()
        previous_live: tuple[int, ...] = tuple(range(self.replicas))
        while not self._budget_spent():
            live = tuple(r for r in range(self.replicas) if not self._down(r, self.now))
            if len(live) < self.replicas and not self.elastic:
                self._wait_for_everyone()
                continue
            if not live:
                self.now = min(self.recorder.trace.outage_at(r, self.now).up_s for r in range(self.replicas))  # type: ignore[union-attr]
                continue
            if live != previous_live:
                previous_live = live
                self.reconfigurations += 1
                self.timeline.reconfigurations += 1
                self.now += self.config.faults.reconfigure_s
                continue  # re-check who is alive after the pause
            self._step(live)
        self._end_of_run()
        return self._result()

    def _wait_for_everyone(self) -> None:
        """Non-elastic: the job is down until every replica is back, then restarts from a checkpoint."""
        failed_at = self.now
        while True:
            outages = [self.recorder.trace.outage_at(r, self.now) for r in range(self.replicas)]
            pending = [o.up_s for o in outages if o is not None]
            if not pending:
                break
            self.now = max(pending)
        self.now += self.config.faults.restart_s
        self.restarts += 1
        lost = self.committed_steps - self._checkpoint["committed_steps"]
        self._restore()
        self.timeline.rollbacks.append(Rollback(round(failed_at, 3), round(self.now, 3),
                                                round(self._checkpoint["at_s"], 3), lost))

    def _step(self, live: tuple[int, ...]) -> None:
        durations = {r: self.recorder.timer.draw(r) for r in live}
        step_s = max(durations.values()) + self._allreduce_s(len(live))
        end = self.now + step_s
        first_failure = min(self.recorder.trace.next_down(r, self.now) for r in live)
        if first_failure < end:
            self.now = first_failure  # the step in flight is lost with the replica
            return
        batches = [self.samplers[r].next_batch() for r in live]
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        self.trainer.step(x, y, self.recorder.run_progress(self.tokens, self.now))
        self.tokens += x.numel()
        self.committed_steps += 1
        per_replica = all_reduce_bytes(self.numel, len(live))
        for r in live:
            self._steps[r] += 1
            self.recorder.accounting.add_step(r, self._steps[r], self.now, end, busy_s=durations[r])
            if self.elastic:
                self.recorder.accounting.credit(r, self._steps[r], self._steps[r], 1.0)
            else:
                self._uncommitted.append((r, self._steps[r]))
            if per_replica:
                for direction in Direction:
                    self.recorder.bytes.add(f"learner-{r}", -1, direction, int(per_replica) + HEADER_BYTES)
        self.now = end
        self.timeline.add(end, Happening.MERGE)
        if not self.elastic and self.now - self._checkpoint["at_s"] >= self.config.faults.checkpoint_interval_s:
            self._commit()
            self._checkpoint = self._snapshot()
        if self.recorder.eval_due(self.tokens, self.now):
            self._evaluate()

    def _end_of_run(self) -> None:
        if self.config.run.time_s:
            self.now = min(self.now, self.config.run.time_s)
        self._commit()  # the final model keeps everything since the last checkpoint

    def _evaluate(self) -> dict[str, Any]:
        return self.recorder.record(
            now=self.now,
            tokens=self.tokens,
            model=self.model,
            extra={"fragment_versions": [self.committed_steps], "alive": self.replicas, **self.events().counters()},
        )

    def events(self) -> RunEvents:
        """What happened up to now: its steps and rollbacks, and its replicas' outages (from the failure trace)."""
        timeline = Timeline(list(self.timeline.entries), rollbacks=list(self.timeline.rollbacks),
                            reconfigurations=self.timeline.reconfigurations)
        for outage in self.recorder.trace.all():
            if outage.down_s <= self.now:
                timeline.add(outage.down_s, Happening.FAILURE, outage.learner)
                if outage.up_s <= self.now:
                    timeline.add(outage.up_s, Happening.RESTART, outage.learner)
        return timeline.summarize(self.now, self.recorder.timer.slow_learners())

    def so_far(self) -> dict[str, Any]:
        """An interrupted run's summary figures (:meth:`ddiloco.sim.harness.Recorder.so_far`)."""
        return {**self.recorder.so_far(self.now, self.tokens), "fragment_versions": [self.committed_steps],
                "events": self.events().to_dict()}

    def _result(self) -> dict[str, Any]:
        return {
            "final": self._evaluate(),
            "weights_sha256": weights_sha256(self.model),
            "fragment_versions": [self.committed_steps],
            "restarts": self.restarts,
            "reconfigurations": self.reconfigurations,
            "steps_per_learner": list(self._steps),
            "events": self.events().to_dict(),
        }
