"""What the synchronizer service measures: goodput, Prometheus counters (bytes on the wire:
:class:`ddiloco.measures.wire_bytes.ByteLedger`, as the virtual cluster counts them).

These are observations of a real run, kept outside the protocol core: the core decides,
the service counts. Everything here is plain bookkeeping with bounded memory.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client import Counter as PromCounter
from prometheus_client.exposition import MetricsHandler

from ddiloco.core.shared.errors import ConfigError
from ddiloco.measures.useful_work import covered_s
from ddiloco.runtime.auth import Address, http_authorized


@dataclass(slots=True)
class GoodputMeter:
    """Goodput and model uptime of a real run, from the rounds the synchronizer merged.

    A merged contribution credits ``compute_s`` (the learner's measured inner-step seconds)
    times the fragment's share of the parameters — the same crediting as the virtual
    cluster's. Goodput = credited seconds / chip seconds, a learner's chip seconds counted from
    its first join (a learner still starting is not idle) to the run's end, when its budget is
    spent (as the run's clock, ``core/sync_side/run_state.py``; the drain, the last evaluation and the final
    checkpoint are not the run's), at most M × wall seconds.
    Uptime = share of wall time, first join to the run's end, covered by credited work, the
    work of a contribution being placed in the ``compute_s`` seconds before it arrived.
    """

    learners: int
    credited_s: float = 0.0
    intervals: list[tuple[float, float]] = field(default_factory=list)
    elapsed_before_s: float = 0.0
    """Wall seconds of previous incarnations of the synchronizer (restored from a checkpoint)."""
    chip_before_s: float = 0.0
    """Chip seconds of previous incarnations."""
    started_s: float | None = None
    """The first join of this incarnation: its run clock starts."""
    ended_s: float | None = None
    """The run's budget was spent (or it finished without learners to drain)."""
    joined_s: dict[str, float] = field(default_factory=dict)
    """Each learner's first join in this incarnation."""
    _covered_s: float = 0.0
    _reach: float = float("-inf")
    max_intervals: int = 4096

    def joined(self, learner_id: str, now: float) -> None:
        if self.started_s is None:
            self.started_s = now
        self.joined_s.setdefault(learner_id, now)

    def finished(self, now: float) -> None:
        if self.ended_s is None:
            self.ended_s = now

    def credit(self, compute_s: float, share: float, arrived_s: float) -> None:
        self.credited_s += compute_s * share
        self.intervals.append((arrived_s - compute_s, arrived_s))
        if len(self.intervals) > self.max_intervals:
            self._fold(len(self.intervals) // 2)

    def _fold(self, n: int) -> None:
        """Fold the oldest ``n`` intervals into the running coverage (bounded memory)."""
        self.intervals.sort()
        covered, self._reach = covered_s(self.intervals[:n], reach=self._reach)
        self._covered_s += covered
        del self.intervals[:n]

    def measured(self, now: float) -> tuple[float, float, float]:
        """(goodput, uptime, wall seconds of this incarnation's run) at ``now``; before the first
        join (a resumed synchronizer) the earlier incarnations' figures, not 0."""
        end = now if self.ended_s is None else min(now, self.ended_s)
        start = end if self.started_s is None else self.started_s
        return self.goodput(end - start, self._chip_s(end)), self.uptime(start, end), end - start

    def _chip_s(self, end: float) -> float:
        """This incarnation's chip seconds until ``end``: at most M × wall seconds (more learners
        than ``run.learners`` may have joined, up to four times as many)."""
        wall_s = 0.0 if self.started_s is None else end - self.started_s
        return min(sum(max(0.0, end - t) for t in self.joined_s.values()), self.learners * wall_s)

    def goodput(self, wall_s: float, chip_s: float | None = None) -> float:
        """Never above 1: the credited seconds are clipped to wall time per learner by the core, but
        more learners than ``run.learners`` may hold leases (up to four times as many)."""
        total = self.chip_before_s + (self.learners * wall_s if chip_s is None else chip_s)
        return min(1.0, self.credited_s / total) if total > 0 else 0.0

    def uptime(self, started_s: float, now_s: float) -> float:
        recent, _ = covered_s(((max(start, started_s), min(end, now_s)) for start, end in self.intervals),
                              reach=self._reach)
        total = self.elapsed_before_s + (now_s - started_s)
        return min(1.0, (self._covered_s + recent) / total) if total > 0 else 0.0

    def state_dict(self, now: float) -> dict[str, float]:
        _, uptime, wall_s = self.measured(now)
        end = now if self.ended_s is None else min(now, self.ended_s)
        return {"credited_s": self.credited_s, "elapsed_s": self.elapsed_before_s + wall_s, "uptime": uptime,
                "chip_s": self.chip_before_s + self._chip_s(end)}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.credited_s = float(state["credited_s"])
        self.elapsed_before_s = float(state["elapsed_s"])
        # A checkpoint from before per-learner chip-time: every learner counted from the first join.
        self.chip_before_s = float(state.get("chip_s", self.learners * self.elapsed_before_s))
        self._covered_s = float(state["uptime"]) * self.elapsed_before_s
        self._reach = float("-inf")
        self.intervals.clear()


class ServiceMetrics:
    """Prometheus counters of one synchronizer (own registry, so several can coexist in tests)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.contributions = PromCounter(
            "ddiloco_contributions", "Contributions received, by outcome (accepted or rejection reason)",
            ["outcome"], registry=self.registry)
        self.rejections = PromCounter(
            "ddiloco_rejections", "Rejected messages by reason", ["reason"], registry=self.registry)
        self.bytes = PromCounter(
            "ddiloco_wire_bytes", "Bytes on the wire by direction, each message with its 5-byte gRPC frame (the "
            "status' bytes_up and bytes_down)", ["direction"], registry=self.registry)
        self.rounds = PromCounter(
            "ddiloco_rounds_closed", "Rounds merged, by why they closed", ["reason"], registry=self.registry)
        self.versions = Gauge(
            "ddiloco_fragment_version", "Current version of each fragment", ["fragment"], registry=self.registry)
        self.alive = Gauge("ddiloco_learners_alive", "Learners holding a lease", registry=self.registry)
        self.coherence = Gauge(
            "ddiloco_merge_coherence", "Coherence of each fragment's last merged round: 1 when the learners' outer "
            "gradients agree, about 1/sqrt(M) when they are orthogonal", ["fragment"], registry=self.registry)
        self.merge_seconds = Histogram(
            "ddiloco_merge_seconds", "Time to merge a round and hand its update to the streams",
            registry=self.registry)
        self.checkpoint_seconds = Histogram(
            "ddiloco_checkpoint_seconds", "Time to write a checkpoint", registry=self.registry)

    def serve(self, bind: Address, token: str | None) -> ThreadingHTTPServer:
        """Expose the metrics at ``http://HOST:PORT/metrics`` on the service's own interface;
        beyond loopback only to requests carrying the run's token (as the status page)."""
        if not bind.is_loopback and token is None:
            raise ConfigError(f"--metrics-port on {bind.host} is reachable beyond this machine: give a shared token "
                              "with --token-file FILE (or $DDILOCO_TOKEN), or listen on 127.0.0.1")
        required = None if bind.is_loopback else token

        class GuardedHandler(MetricsHandler.factory(self.registry)):  # type: ignore[misc]
            def do_GET(self) -> None:  # noqa: N802 (the http.server API)
                query = parse_qs(urlsplit(self.path).query).get("token", [""])[0]
                if not http_authorized(required, self.headers.get("Authorization", ""), query):
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", "Bearer")
                    self.end_headers()
                    return
                super().do_GET()

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the http.server API)
                pass

        try:
            httpd = ThreadingHTTPServer((bind.host, bind.port), GuardedHandler)
        except OSError as err:
            raise ConfigError(f"--metrics-port {bind.port}: cannot listen on {bind} ({err.strerror or err})") from None
        httpd.daemon_threads = True
        threading.Thread(target=httpd.serve_forever, name="metrics", daemon=True).start()
        return httpd
