"""Hosts in network namespaces on capped links (``--hosts netns``): caps in force, nothing left behind.

These need root and a working ``ip netns``; elsewhere they skip with the reason. Rates are
checked as upper bounds that a token bucket guarantees on any machine, however loaded
(at most rate x time + burst passes), and the shaper's own counters show that it held
traffic back: no assertion depends on how fast this machine is.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from ddiloco.runtime.launch.netns import MIN_BURST_BYTES, NetnsHosts, leftovers, remove_stale, tag_of
from ddiloco.runtime.launch.topology import Link, Region, Topology
from ddiloco.testing import ddiloco_session, netns_unavailable, session_pids, wait_for

UNAVAILABLE = netns_unavailable()
pytestmark = pytest.mark.skipif(bool(UNAVAILABLE), reason=UNAVAILABLE or "network namespaces available")

SINK = """
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 5999)); s.listen(8)
print("listening", flush=True)
while True:
    c, _ = s.accept()
    while c.recv(65536): pass
"""
SOURCE = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], 5999)); end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end: c.sendall(b"x" * 65536)
"""


def allowed_bytes(rate_bps: float, seconds: float) -> float:
    """What a token bucket lets through in ``seconds`` (framing counted alike on both sides: 2% slack)."""
    return rate_bps / 8 * seconds * 1.02 + max(MIN_BURST_BYTES, rate_bps / 8 * 0.01)


def overlimits(stats: str) -> int:
    match = re.search(r"overlimits (\d+)", stats)
    return int(match.group(1)) if match else 0


def settled(net: NetnsHosts, timeout_s: float = 30.0) -> dict:
    """The links' counters once two readings 50 ms apart agree (the queues drained), or fail at the deadline."""
    readings = [net.counters()]

    def unchanged() -> dict | None:
        readings.append(net.counters())
        return readings[-1] if readings[-1] == readings[-2] else None

    return wait_for(unchanged, "the links' queues to drain", timeout_s=timeout_s, poll_s=0.05)


@pytest.mark.slow
def test_capped_links_hold_their_rates_own_and_shared_and_leave_nothing_behind() -> None:
    topology = Topology(Link(), (Region("a", Link(2e6, 2e6), ("learner-0",)),
                                 Region("b", Link(1e6, 1e6), ("learner-1", "learner-2"))))
    net = NetnsHosts.create(topology, ["sync", "learner-0", "learner-1", "learner-2"])
    try:
        sink = subprocess.Popen([*net.prefix("sync"), sys.executable, "-c", SINK, net.address("sync")],
                                stdout=subprocess.PIPE, text=True)
        assert sink.stdout.readline().strip() == "listening"
        before, started = net.counters(), time.monotonic()
        sources = [subprocess.Popen([*net.prefix(h), sys.executable, "-c", SOURCE, net.address("sync"), "2"])
                   for h in ("learner-0", "learner-1")]
        for source in sources:
            assert source.wait(60) == 0
        after = settled(net)  # the last queued packets (100 ms of queue at most) reach the counters
        elapsed = time.monotonic() - started
        sink.kill()
        sink.wait()
        sent = {name: after[name]["up"] - before[name]["up"] for name in after}
        assert 0 < sent["learner-0"] <= allowed_bytes(2e6, elapsed)
        assert 0 < sent["region:b"] <= allowed_bytes(1e6, elapsed)  # learner-1's traffic, on its region's link
        assert sent["learner-1"] >= sent["region:b"]  # its own link is not capped: the region's is
        assert overlimits(net.qdisc_stats("learner-0")[1]) > 0  # the bucket held packets back: the cap was in force
        assert "tbf" not in net.qdisc_stats("learner-1")[1]
    finally:
        net.remove()
    assert leftovers(net.tag) == []


def test_link_faults_take_the_link_down_and_change_its_cap() -> None:
    net = NetnsHosts.create(Topology(Link(), (Region("a", Link(5e6, 5e6), ("learner-0",)),)), ["sync", "learner-0"])
    try:
        outer = net.links["learner-0"].outer
        net.set_down("learner-0", True)
        assert "state DOWN" in subprocess.run(["ip", "link", "show", outer], capture_output=True, text=True).stdout
        net.set_down("learner-0", False)
        net.set_rate("learner-0", 64_000)
        assert all("rate 64Kbit" in stats for stats in net.qdisc_stats("learner-0"))
        net.set_rate("learner-0", None)
        assert all("rate 5Mbit" in stats for stats in net.qdisc_stats("learner-0"))
    finally:
        net.remove()


OWNER = """
import sys, time
from ddiloco.runtime.launch.netns import NetnsHosts
from ddiloco.runtime.launch.topology import uniform
NetnsHosts.create(uniform(["learner-0"], 1e6), ["sync", "learner-0"])
print("ready", flush=True)
time.sleep(600)
"""


def test_what_a_killed_run_left_is_removed_by_the_next_start_and_a_live_run_is_left_alone() -> None:
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
    live = NetnsHosts.create(Topology(Link(), (Region("a", Link(), ("learner-0",)),)), ["learner-0"])
    try:
        assert owner.stdout.readline().strip() == "ready"
        tag = tag_of(owner.pid)
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        left = leftovers(tag)
        assert f"ddiloco-{tag}-sync" in left and f"dd{tag}-b" in left
        removed = remove_stale()
        assert set(left) <= set(removed) and leftovers(tag) == []
        assert leftovers(live.tag)  # this process is alive: its namespaces stay
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        live.remove()
    assert leftovers(live.tag) == []


@pytest.mark.slow
def test_two_learners_train_on_capped_links_and_the_run_leaves_nothing_behind(tmp_path) -> None:
    out = tmp_path / "out"
    rate = 256_000  # below what the tiny preset's learners would send: the cap must bind
    proc = ddiloco_session("run", "--runtime", "processes", "--preset", "tiny", "--learners", "2", "--time", "12",
                           "--hosts", "netns", "--link-rate", "256kbit", out=out)
    tag = tag_of(proc.pid)
    try:
        # While it runs: the learner's link has its token bucket, and the bucket holds packets back.
        wait_for(lambda: overlimits(subprocess.run(["tc", "-s", "qdisc", "show", "dev", f"dd{tag}-h1"],
                                                   capture_output=True, text=True).stdout) > 0,
                 "learner-0's capped link to hold traffic back", timeout_s=240)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, stdout + stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["hosts"] == "netns" and all(steps > 0 for steps in summary["own_steps_per_learner"])
    for name in ("learner-0", "learner-1"):
        for direction in ("up", "down"):
            assert 0 < summary["links"][name][direction] <= allowed_bytes(rate, summary["wall_time_s"])
    assert leftovers(tag) == [] and not session_pids(proc.pid)
