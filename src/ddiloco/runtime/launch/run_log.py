"""``timeline.jsonl``: once a second, what a local run looked like from outside its processes.

Each line: seconds since launch, each learner's own step count (its progress file: it counts
steps the synchronizer may never see), what the synchronizer merged (fragment versions,
accepted contributions per learner), and the bytes so far on every link of ``--hosts
netns``. ``benchmarks/bench_wan.py`` computes its rates from these lines; a person can
read where a run starved.

At the end it gives ``summary.json``'s ``events`` (the "what happened" panel), with the keys the
virtual cluster's have (``sim/timeline.py``'s ``RunEvents``), from what the synchronizer counted
and from when the polls (every ``launcher.POLL_S``) saw the global model move.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from ddiloco.runtime.launch.placement import Placement
from ddiloco.runtime.progress import read_progress

RECORD_EVERY_S = 1.0


class RunTimeline:
    def __init__(self, out: Path, learners: list[str], placement: Placement) -> None:
        self.progress_dir = out / "progress"
        self.progress_dir.mkdir(exist_ok=True)
        for stale in self.progress_dir.glob("*.json"):
            stale.unlink()
        self.learners = learners
        self.placement = placement
        self.started = time.monotonic()
        self._file = (out / "timeline.jsonl").open("w")
        self._last = -RECORD_EVERY_S
        self.first_links = placement.counters()
        self.last_links = self.first_links
        self._merged = 0
        self._moved_at: list[float] = []
        """When a poll first saw the global model move (the fragment versions' sum, data parallel's steps)."""
        self._finished_at: float | None = None

    def progress_file(self, learner: str) -> Path:
        return self.progress_dir / f"{learner}.json"

    def steps(self) -> dict[str, int]:
        """Each learner's own step count so far (0 before its first report)."""
        return {name: (read_progress(self.progress_file(name)) or {}).get("steps", 0) for name in self.learners}

    def record(self, status: dict[str, Any] | None, *, force: bool = False) -> None:
        """Append a line if a second has passed since the last one (or ``force``)."""
        t = time.monotonic() - self.started
        if status is not None:
            self._progressed(t, sum(f["version"] for f in status["fragments"]))
            if status["finished"] and self._finished_at is None:
                self._finished_at = t
        if not force and t - self._last < RECORD_EVERY_S:
            return
        self._last = t
        self.last_links = self.placement.counters()
        steps = self.steps()
        if status is None:  # data parallel: the model moves with the ranks' steps (seen once a row)
            self._progressed(t, sum(steps.values()))
        row: dict[str, Any] = {"t": round(t, 3), "time": round(time.time(), 3), "steps": steps,
                               "links": self.last_links}
        if status is not None:
            row.update(tokens=status["tokens"], versions=[f["version"] for f in status["fragments"]],
                       accepted={lr["id"]: lr["accepted"] for lr in status["learners"]},
                       alive={lr["id"]: lr["alive"] for lr in status["learners"]})
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def link_totals(self) -> dict[str, dict[str, int]]:
        """Bytes per link and direction over the run so far."""
        return {name: {d: now[d] - self.first_links[name][d] for d in now} for name, now in self.last_links.items()}

    def _progressed(self, t: float, moved: int) -> None:
        if moved > self._merged:
            self._merged = moved
            self._moved_at.append(t)

    def events(self, *, merges: int, rejoins: int, failures: int, end_s: float) -> dict[str, Any]:
        """``summary.json``'s ``events`` at the end of the run: ``merges`` and ``rejoins`` as the
        synchronizer counted them (data parallel: its steps, none), ``failures`` the processes that
        died, and the longest pause between merges to the polls' resolution, until the run finished
        (``end_s`` if it did not)."""
        end_s = end_s if self._finished_at is None else self._finished_at
        moved = self._moved_at
        gaps = list(zip(moved, [*moved[1:], end_s])) if moved else [(0.0, end_s)]
        start_s, stop_s = max(gaps, key=lambda gap: gap[1] - gap[0])
        return {"failures": failures, "rejoins": rejoins, "merges": merges,
                "longest_pause_s": round(stop_s - start_s, 3), "longest_pause_from_s": round(start_s, 3),
                "slow_learners": [], "outages": [], "rejoined_at": [], "rollbacks": [], "reconfigurations": 0}

    def close(self) -> None:
        self._file.close()


def read_timeline(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
