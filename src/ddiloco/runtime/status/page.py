"""``ddiloco sync --http-port PORT``: a live status page (``/``) and its JSON (``/api/status``).

The page shows the very dict ``ddiloco status --json`` prints (:func:`~ddiloco.runtime.status.wire_form.status_to_dict`),
plus a short in-memory history of fragment versions so the page can chart progress. It is
served by the standard library's threaded HTTP server, in a process of its own that reads the
synchronizer's published status (:mod:`~ddiloco.runtime.status.page_process`): a slow browser
never stalls a merge, and a busy synchronizer never stalls the page. No protocol logic lives
here.

Token rule (same as the gRPC service): on a loopback bind nobody needs a token; beyond
loopback every request must carry the run's token, as ``Authorization: Bearer TOKEN`` or
``?token=TOKEN`` (the page passes its own ``?token=`` on to ``/api/status``).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any, Callable
from urllib.parse import parse_qs, urlsplit

from ddiloco.core.shared.errors import ConfigError
from ddiloco.runtime.auth import Address, http_authorized

log = logging.getLogger("ddiloco.sync")

HISTORY_LEN = 1800
"""Samples kept for the chart (30 min at one a second): bounded memory for runs of any length."""
SAMPLE_EVERY_S = 1.0

StatusFn = Callable[[], dict[str, Any]]


def page_html() -> bytes:
    """The single self-contained page (inline CSS and JS, nothing from the internet)."""
    return resources.files("ddiloco.runtime.status").joinpath("static/status.html").read_bytes()


class StatusPage:
    """Bound at construction (so a port in use fails before the synchronizer starts), served by ``start``."""

    def __init__(self, bind: Address, token: str | None) -> None:
        if not 0 <= bind.port <= 65535:
            raise ConfigError(f"--http-port {bind.port}: must be in 0..65535")
        self.token = token if not bind.is_loopback else None
        if not bind.is_loopback and token is None:
            raise ConfigError(f"--http-port on {bind.host} is reachable beyond this machine: give a shared token "
                              "with --token-file FILE (or $DDILOCO_TOKEN), or listen on 127.0.0.1")
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY_LEN)
        self._lock = threading.Lock()
        self._fetch: StatusFn | None = None
        self._stop = threading.Event()
        try:
            self.httpd = ThreadingHTTPServer((bind.host, bind.port), _handler_for(self))
        except OSError as err:
            raise ConfigError(f"--http-port {bind.port}: cannot listen on {bind} ({err.strerror or err})") from None
        self.httpd.daemon_threads = True
        self.host = bind.host
        self.port: int = self.httpd.server_address[1]

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}/"

    def attach(self, fetch: StatusFn) -> None:
        """Give the page its source of status (until then it answers 503 "starting")."""
        self._fetch = fetch

    def start(self) -> None:
        threading.Thread(target=self.httpd.serve_forever, name="status-page", daemon=True).start()
        threading.Thread(target=self._sample, name="status-history", daemon=True).start()
        log.info("status page at %s", self.url)

    def close(self) -> None:
        self._stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def status(self) -> dict[str, Any] | None:
        """The status dict plus ``history``; None while the synchronizer is not answering yet."""
        fetch = self._fetch
        if fetch is None:
            return None
        try:
            status = fetch()
        except Exception as err:  # nothing published yet, or the synchronizer stopping: the page just retries
            log.debug("status page: no status (%s)", err)
            return None
        self._record(status)
        with self._lock:
            status["history"] = list(self.history)
        return status

    def _record(self, status: dict[str, Any]) -> None:
        """Keep at most one sample per ``SAMPLE_EVERY_S``, however often browsers ask."""
        sample = {"t": status["uptime"], "tokens": status["tokens"],
                  "versions": {str(f["id"]): f["version"] for f in status["fragments"]}}
        with self._lock:
            if not self.history or sample["t"] - self.history[-1]["t"] >= SAMPLE_EVERY_S * 0.9:
                self.history.append(sample)

    def _sample(self) -> None:
        """Sample even when nobody is watching, so an opened page shows the run so far."""
        while not self._stop.wait(SAMPLE_EVERY_S):
            self.status()

    def authorized(self, headers: Any, query: str) -> bool:
        return http_authorized(self.token, headers.get("Authorization", ""), parse_qs(query).get("token", [""])[0])


def _handler_for(page: StatusPage) -> type[BaseHTTPRequestHandler]:
    class StatusPageHandler(BaseHTTPRequestHandler):
        server_version = "ddiloco-status"

        def do_GET(self) -> None:  # noqa: N802 (the http.server API)
            parts = urlsplit(self.path)
            if not page.authorized(self.headers, parts.query):
                self._send(401, "text/plain; charset=utf-8",
                           b"a token is required: Authorization: Bearer TOKEN or ?token=TOKEN\n",
                           {"WWW-Authenticate": "Bearer"})
            elif parts.path in ("/", "/index.html"):
                self._send(200, "text/html; charset=utf-8", page_html())
            elif parts.path == "/api/status":
                status = page.status()
                if status is None:
                    self._send(503, "application/json", b'{"error": "synchronizer starting"}\n')
                else:
                    self._send(200, "application/json", json.dumps(status).encode())
            else:
                self._send(404, "text/plain; charset=utf-8", b"not found\n")

        def _send(self, code: int, ctype: str, body: bytes, extra: dict[str, str] | None = None) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            for key, value in (extra or {}).items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the http.server API)
            log.debug("status page: " + format, *args)

    return StatusPageHandler

