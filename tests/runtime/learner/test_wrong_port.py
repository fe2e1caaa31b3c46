"""Issue 29: a command pointed at the wrong port says so in one line (real processes).

``ddiloco status`` pointed at the status page's port printed gRPC's "Failed parsing HTTP/2";
a learner pointed at a port where no synchronizer answers must say so at INFO, warn once
it lasts, and give up at ``--join-timeout`` with one line.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time

import pytest

from ddiloco.core.learner_side.link_watch import OUTAGE_AFTER_S
from ddiloco.core.shared.errors import DdilocoError
from ddiloco.runtime.client import SyncClient
from ddiloco.runtime.learner.connect import probe_with_backoff
from ddiloco.testing import DEADLINE_S, free_port, learner_args, status_of, sync_args, wait_for

pytestmark = pytest.mark.slow


def ddiloco(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddiloco.cli", *args], capture_output=True, text=True,
                          timeout=DEADLINE_S)


def test_status_and_a_learner_pointed_at_the_http_ports_say_which_port_they_reached(procs) -> None:
    port, http_port, metrics_port = free_port(), free_port(), free_port()
    procs.start("sync", *sync_args(port, "--tokens", str(10**9), "--http-port", str(http_port),
                                   "--metrics-port", str(metrics_port)))
    wait_for(lambda: status_of(port), "the synchronizer to answer")
    for wrong, which in ((http_port, "the status page (ddiloco sync --http-port)"),
                         (metrics_port, "the metrics port (ddiloco sync --metrics-port)")):
        done = ddiloco("status", f"127.0.0.1:{wrong}")
        assert done.returncode != 0 and "Traceback" not in done.stderr and "HTTP/2" not in done.stderr
        assert done.stderr == (f"ddiloco: error: 127.0.0.1:{wrong} answers HTTP, it is {which}; point ddiloco status "
                               "at the synchronizer's gRPC port (the one `ddiloco sync --listen` names)\n")
    assert ddiloco("status", f"127.0.0.1:{port}").returncode == 0  # the gRPC port is still the right one

    started = time.monotonic()
    done = ddiloco(*learner_args(http_port, "learner-0", "--join-timeout", str(OUTAGE_AFTER_S + 5)))
    assert done.returncode != 0 and "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert sum("waiting for the synchronizer" in line and "INFO" in line for line in lines) == 1, done.stderr
    (warning,) = [line for line in lines if "WARNING" in line]
    assert f"127.0.0.1:{http_port} answers HTTP, it is the status page" in warning, done.stderr
    assert lines[-1] == (f"ddiloco: error: 127.0.0.1:{http_port} answers HTTP, it is the status page (ddiloco sync "
                         "--http-port); point --connect at the synchronizer's gRPC port (the one `ddiloco sync "
                         f"--listen` names); gave up after {OUTAGE_AFTER_S + 5:g} s (--join-timeout)"), done.stderr
    assert time.monotonic() - started < DEADLINE_S


def test_a_learner_where_nothing_answers_waits_at_info_warns_then_gives_up_at_the_join_timeout(caplog) -> None:
    caplog.set_level(logging.INFO, logger="ddiloco.learner")
    timeout_s = OUTAGE_AFTER_S + 5
    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    with SyncClient(address) as client, pytest.raises(DdilocoError) as failed:
        probe_with_backoff(client, "learner-0", timeout_s=timeout_s)
    waited_s = time.monotonic() - started
    assert timeout_s - 3 <= waited_s <= timeout_s + 5  # it gives up before a retry would pass the deadline
    message = str(failed.value)
    assert message.startswith(f"no answer from the synchronizer at {address} in {timeout_s:g} s (--join-timeout)")
    assert "\n" not in message
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in said] == [logging.INFO, logging.WARNING], said  # one line, then one warning
    assert said[0][1].startswith(f"waiting for the synchronizer at {address}")
    assert said[1][1].startswith(f"no answer from the synchronizer at {address} for")
    assert "still trying" in said[1][1].lower() and "--join-timeout" in said[1][1]
