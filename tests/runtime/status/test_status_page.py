"""The live status page of ``ddiloco sync --http-port``: its JSON, its token rule, its process
(which answers while the synchronizer cannot), and the page itself as a real headless browser
renders it.

Every wait polls with a generous deadline; nothing asserts on timing.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from page_client import CHROMIUM, api_status, browse, get

from ddiloco.core.shared.errors import ConfigError
from ddiloco.runtime.auth import Address
from ddiloco.runtime.status.page import StatusPage
from ddiloco.testing import DEADLINE_S, free_port, learner_args, process_state, sync_args, wait_for

PACE = ("--min-step-s", "0.02")
"""Pace the tiny learners so that two of them, a synchronizer and a browser share 2 cores calmly."""


def max_version(status: dict | None) -> int:
    return max((f["version"] for f in status["fragments"]), default=-1) if status else -1


FAKE = {"uptime": 1.0, "tokens": 5, "fragments": [{"id": 0, "version": 3}]}


def test_page_and_json_with_the_token_rule_beyond_loopback() -> None:
    page = StatusPage(Address("0.0.0.0", 0), token="s3cret")
    page.attach(lambda: dict(FAKE))
    page.start()
    try:
        base = f"http://127.0.0.1:{page.port}"
        assert get(f"{base}/api/status")[0] == 401
        assert get(f"{base}/")[0] == 401
        assert get(f"{base}/api/status?token=wrong")[0] == 401
        assert get(f"{base}/api/status", {"Authorization": "Bearer wrong"})[0] == 401
        code, body = get(f"{base}/api/status", {"Authorization": "Bearer s3cret"})
        assert code == 200 and json.loads(body)["fragments"][0]["version"] == 3
        assert json.loads(body)["history"][-1]["versions"] == {"0": 3}
        code, body = get(f"{base}/?token=s3cret")
        assert code == 200 and b"/api/status" in body and b"<script" in body
        assert b"http://" not in body and b"https://" not in body  # nothing fetched from the internet
        assert get(f"{base}/nope?token=s3cret")[0] == 404
    finally:
        page.close()


def test_loopback_needs_no_token_and_beyond_loopback_needs_one() -> None:
    page = StatusPage(Address("127.0.0.1", 0), token="ignored-on-loopback")
    try:
        page.start()
        assert get(f"http://127.0.0.1:{page.port}/api/status")[0] == 503  # no status source yet: "starting"
        assert get(f"http://127.0.0.1:{page.port}/")[0] == 200
    finally:
        page.close()
    with pytest.raises(ConfigError, match="token"):
        StatusPage(Address("0.0.0.0", 0), token=None)


def test_a_port_in_use_is_a_clear_error() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(ConfigError, match=f"--http-port {busy.getsockname()[1]}: cannot listen"):
            StatusPage(Address("127.0.0.1", busy.getsockname()[1]), token=None)


@pytest.mark.slow
def test_sync_with_a_busy_http_port_exits_with_one_line() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        http_port = busy.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "ddiloco.cli", *sync_args(free_port(), "--http-port", str(http_port))],
                              capture_output=True, text=True, timeout=DEADLINE_S)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("ddiloco: error: --http-port") and "Traceback" not in done.stderr, done.stderr


def start_run(procs, learners: int = 2) -> int:
    """A synchronizer with a status page and ``learners`` paced learners; returns the HTTP port."""
    port, http_port = free_port(), free_port()
    procs.start("sync", *sync_args(port, "--tokens", str(10**9), "--http-port", str(http_port), learners=learners))
    for i in range(learners):
        procs.start(f"learner-{i}", *learner_args(port, f"learner-{i}", *PACE))
    return http_port


@pytest.mark.slow
def test_api_status_versions_advance(procs) -> None:
    http_port = start_run(procs)
    first = wait_for(lambda: (s := api_status(http_port)) and max_version(s) >= 1 and s, "a first merge")
    assert {lr["id"] for lr in first["learners"]} <= {"learner-0", "learner-1"}
    later = wait_for(lambda: (s := api_status(http_port)) and max_version(s) >= max_version(first) + 3 and s,
                     "versions to advance")
    assert later["uptime"] >= first["uptime"]
    # The history the chart draws: samples in time order whose versions never go back.
    history = wait_for(lambda: (s := api_status(http_port)) and len(s["history"]) >= 2 and s["history"],
                       "two history samples")
    assert [h["t"] for h in history] == sorted(h["t"] for h in history)
    assert max(history[-1]["versions"].values()) >= max(history[0]["versions"].values())


def dom_versions(dom: str) -> list[int]:
    return [int(v) for v in re.findall(r'<td class="version">(\d+)</td>', dom)]


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary on PATH (apt-get install chromium)")
def test_page_in_a_headless_browser(procs, tmp_path) -> None:
    http_port = start_run(procs)
    url = f"http://127.0.0.1:{http_port}/"
    wait_for(lambda: max_version(api_status(http_port)) >= 1, "a first merge")
    profile = tmp_path / "chromium"

    def rendered() -> str | None:
        dom = browse(url, profile, "--dump-dom")
        return dom if "learner-0" in dom and "learner-1" in dom and dom_versions(dom) else None

    dom = wait_for(rendered, "the page to show both learners and fragment versions", poll_s=1.0)
    seen = max(dom_versions(dom))
    wait_for(lambda: max_version(api_status(http_port)) > seen, "the run to advance past the rendered version")
    later = wait_for(lambda: (d := rendered()) and max(dom_versions(d)) > seen and d,
                     "the page to show a larger version", poll_s=1.0)
    assert 'id="conn" class="ok"' in later  # the last fetch of /api/status succeeded
    shot = tmp_path / "status.png"
    browse(url, profile, f"--screenshot={shot}", "--window-size=1200,900")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def page_process(sync_pid: int) -> int:
    """The status page's process: the synchronizer's one child."""
    children = Path(f"/proc/{sync_pid}/task/{sync_pid}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


@pytest.mark.slow
def test_the_page_answers_while_the_synchronizer_is_stopped_and_goes_with_it(procs, tmp_path) -> None:
    """A SIGSTOPped synchronizer answers nothing; its page still answers, from the last status
    published, and says how old that is (the page, in a browser: "silent"). ``kill -9`` of the
    synchronizer takes the page down too."""
    port, http_port = free_port(), free_port()
    sync = procs.start("sync", *sync_args(port, "--http-port", str(http_port)))
    wait_for(lambda: api_status(http_port), "the page's first status")
    page_pid = page_process(sync.pid)
    os.kill(sync.pid, signal.SIGSTOP)
    try:
        stale = wait_for(lambda: (s := api_status(http_port)) and s["age_s"] >= 2.0 and s,
                         "the page to answer with a status over 2 s old")
        assert stale["phase"] and stale["fragments"]  # the last status published, whole
        if CHROMIUM is not None:
            wait_for(lambda: api_status(http_port)["age_s"] > 6.0, "a status over 6 s old")
            dom = browse(f"http://127.0.0.1:{http_port}/", tmp_path / "chromium", "--dump-dom")
            assert re.search(r'id="conn" class="bad">synchronizer silent for \d+ s<', dom), dom[-2000:]
    finally:
        os.kill(sync.pid, signal.SIGCONT)
    wait_for(lambda: (s := api_status(http_port)) and s["age_s"] < 2.0, "fresh status again")
    procs.kill9("sync")
    wait_for(lambda: process_state(page_pid) in ("", "Z"), "the page process to exit")
    assert get(f"http://127.0.0.1:{http_port}/api/status")[0] == 0
