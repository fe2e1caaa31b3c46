"""What the synchronizer service measures: goodput, Prometheus counters (bytes on the wire:
:class:`ddiloco.measures.ByteLedger`, as the virtual cluster counts them).

These are observations of a real run, kept outside the protocol core: the core decides,
the service counts. Everything here is plain bookkeeping with bounded memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import threading
from http.server import ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CollectorRegistry, Counter as PromCounter, Gauge, Histogram
from prometheus_client.exposition import MetricsHandler

from ddiloco.errors import ConfigError
from ddiloco.measures import covered_s
from ddiloco.runtime.auth import Address, http_authorized

@dataclass(slots=True)
class GoodputMeter:
    """Goodput and model uptime of a real run, from the rounds the synchronizer merged.

    A merged contribution credits ``compute_s`` (the learner's measured inner-step seconds)
    times the fragment's share of the parameters — the same crediting as the virtual
    cluster's. Goodput = credited seconds / (M × wall seconds since the first join).
    Uptime = share of wall time covered by credited work, the work of a contribution being
    placed in the ``compute_s`` seconds before it arrived at the synchronizer.
    """

    learners: int
    credited_s: float = 0.0
    intervals: list[tuple[float, float]] = field(default_factory=list)
    elapsed_before_s: float = 0.0
    """Wall seconds of previous incarnations of the synchronizer (restored from a checkpoint)."""
    _covered_s: float = 0.0
    _reach: float = float("-inf")
    max_intervals: int = 4096

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

    def goodput(self, wall_s: float) -> float:
        """Never above 1: the credited seconds are clipped to wall time per learner by the core, but
        more learners than ``run.learners`` may hold leases (up to four times as many)."""
        total = self.elapsed_before_s + wall_s
        return min(1.0, self.credited_s / (self.learners * total)) if total > 0 else 0.0

    def uptime(self, started_s: float, now_s: float) -> float:
        recent, _ = covered_s(((max(start, started_s), min(end, now_s)) for start, end in self.intervals),
                              reach=self._reach)
        total = self.elapsed_before_s + (now_s - started_s)
        return min(1.0, (self._covered_s + recent) / total) if total > 0 else 0.0

    def state_dict(self, wall_s: float, uptime: float) -> dict[str, float]:
        return {"credited_s": self.credited_s, "elapsed_s": self.elapsed_before_s + wall_s, "uptime": uptime}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.credited_s = float(state["credited_s"])
        self.elapsed_before_s = float(state["elapsed_s"])
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

        class Handler(MetricsHandler.factory(self.registry)):  # type: ignore[misc]
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
            httpd = ThreadingHTTPServer((bind.host, bind.port), Handler)
        except OSError as err:
            raise ConfigError(f"--metrics-port {bind.port}: cannot listen on {bind} ({err.strerror or err})") from None
        httpd.daemon_threads = True
        threading.Thread(target=httpd.serve_forever, name="metrics", daemon=True).start()
        return httpd
