"""Far-apart hosts on one machine: a network namespace per host, capped links between them.

``--hosts netns`` puts the synchronizer and every learner in a network namespace of its
own. Namespaces are joined by veth pairs to one bridge in the launcher's namespace (which
gets the subnet's first address, so the launcher can watch the run and ``ddiloco chaos``
can put its proxies on the path). A region of several learners (:mod:`ddiloco.runtime.launch.topology`)
has a bridge of its own, joined to the core bridge by one trunk veth pair: its learners
share that link, as they would share a region's wide-area link.

Links are capped with ``tc``'s token bucket filter (``tbf``) on the egress of both ends of
their veth pair: the namespace's end shapes what leaves it (up), the bridge's end what
enters it (down). ``tbf`` is a real queue: a packet over the rate waits, a full queue
drops, and TCP's congestion control sees exactly what it would see on a slow wide-area
link (without its latency: this kernel has no ``netem``; ``ddiloco chaos`` adds latency in
its proxy).

Everything is named after the launcher's process id (``ddiloco-<tag>-<host>`` for
namespaces, ``dd<tag>-<kind><n>`` for links, the tag being the pid in base 36), so that
:func:`remove_stale` can find and remove what a run killed with ``kill -9`` left behind
without touching a live run's. :meth:`NetnsHosts.remove` removes a run's own; namespaces go
with everything inside them (veth ends and their qdiscs).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from ddiloco.core.shared.errors import ConfigError, DdilocoError
from ddiloco.runtime.launch.topology import Link, Topology

NS_PREFIX = "ddiloco-"
SYNC_HOST = "sync"
SUBNET = "10.250"
"""Each run takes a free 10.250.X.0/24 for its bridge; its addresses exist only on this machine."""
LOCK_FILE = Path("/run/lock/ddiloco-netns.lock")
INNER_IFNAME = "eth0"
"""The veth end inside every namespace (gloo picks it with GLOO_SOCKET_IFNAME)."""
TBF_LATENCY = "100ms"
"""How long a packet may wait in a capped link's queue before it is dropped (a router's buffer)."""
TBF_BURST_S = 0.01
"""Bytes a link may send back to back: 10 ms of its rate ..."""
MIN_BURST_BYTES = 3000
"""... and at least two full frames."""
MAX_HOSTS = 240
_LINK_NAME = re.compile(r"dd([0-9a-z]{1,6})-[a-z]\d*")
_ACTIVE: set[str] = set()
"""Tags whose hosts this process created and has not removed yet."""


def tag_of(pid: int) -> str:
    """The pid in base 36: 5 characters at most for any Linux pid, so link names fit in 15."""
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        pid, r = divmod(pid, 36)
        out = digits[r] + out
        if pid == 0:
            return out


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(list(args), capture_output=True, text=True)
    if check and result.returncode != 0:
        raise DdilocoError(f"{' '.join(args)} failed: {(result.stderr or result.stdout).strip()}")
    return result


def check_available() -> None:
    """One ConfigError line when this process cannot make namespaces (not root, no ``ip``/``tc``)."""
    if os.geteuid() != 0:
        raise ConfigError("--hosts netns needs root (network namespaces, veth pairs and tc); "
                          "run as root or use --hosts local")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise ConfigError(f"--hosts netns needs iproute2's {missing[0]!r} command, which is not installed")
    probe = f"{NS_PREFIX}{tag_of(os.getpid())}-probe"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        raise ConfigError(f"--hosts netns: `ip netns add` does not work here: {made.stderr.strip()}")
    _run("ip", "netns", "del", probe, check=False)


def _owner_alive(tag: str) -> bool:
    """Whether the run named ``tag`` may still be running (its launcher's pid runs Python; this process
    only if it created them: an earlier process with the same pid left them)."""
    try:
        pid = int(tag, 36)
        if pid == os.getpid():
            return tag in _ACTIVE
        return b"python" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except (ValueError, OSError):
        return False


def remove_stale() -> list[str]:
    """Remove the namespaces and links of runs whose launcher is gone; return their names."""
    removed = []
    for name in _root_links():  # links first: deleting one deletes its peer at once (a namespace goes lazily)
        match = _LINK_NAME.fullmatch(name)
        if match and not _owner_alive(match.group(1)):
            _run("ip", "link", "del", name, check=False)
            removed.append(name)
    for name in _namespaces():
        if name.startswith(NS_PREFIX) and not _owner_alive(name[len(NS_PREFIX):].split("-")[0]):
            _remove_namespace(name)
            removed.append(name)
    return removed


def _namespaces() -> list[str]:
    """Every named network namespace (``ip netns list`` adds "(id: N)" after some)."""
    return [line.split()[0] for line in _run("ip", "netns", "list").stdout.splitlines() if line.strip()]


def _root_links() -> list[str]:
    names = []
    for line in _run("ip", "-o", "link", "show").stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        names.append(name)
    return names


def _remove_namespace(name: str) -> None:
    """Kill what still runs inside (a dead run's orphan), then delete the namespace."""
    for pid in _run("ip", "netns", "pids", name, check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), 9)
    _run("ip", "netns", "del", name, check=False)


def leftovers(tag: str) -> list[str]:
    """Namespaces and links of run ``tag`` that still exist (empty once it is removed)."""
    namespaces = [n for n in _namespaces() if n.startswith(f"{NS_PREFIX}{tag}-")]
    return namespaces + [n for n in _root_links() if n.startswith(f"dd{tag}-")]


@dataclass
class _HostLink:
    """A host's own veth pair: the bridge's end (root namespace) and its base cap."""

    outer: str
    link: Link


@dataclass
class NetnsHosts:
    """The namespaces, bridges and capped links of one run (see the module's docstring)."""

    tag: str
    topology: Topology
    subnet: str
    hosts: list[str]
    links: dict[str, _HostLink] = field(default_factory=dict)
    trunks: dict[str, str] = field(default_factory=dict)
    """Region name -> the core bridge's end of its trunk (regions of more than one learner)."""
    created: list[str] = field(default_factory=list)

    @classmethod
    def create(cls, topology: Topology, hosts: list[str]) -> "NetnsHosts":
        """Namespaces for ``hosts`` (``sync`` and/or learner ids) on ``topology``'s links; all or nothing."""
        if len(hosts) > MAX_HOSTS:
            raise ConfigError(f"--hosts netns gives each host an address of one /24: at most {MAX_HOSTS} hosts, "
                              f"got {len(hosts)}")
        check_available()
        remove_stale()
        tag = tag_of(os.getpid())
        if tag in _ACTIVE:
            raise DdilocoError(f"this process already runs namespaces {leftovers(tag)}: "
                               "one --hosts netns run at a time")
        LOCK_FILE.parent.mkdir(parents=True, exist_ok=True)
        with open(LOCK_FILE, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # two runs starting at once must not take one subnet
            net = cls(tag, topology, _free_subnet(), hosts)
            _ACTIVE.add(tag)
            try:
                net._build()
            except BaseException:
                net.remove()
                raise
        return net

    # ---- names and addresses --------------------------------------------------------------

    def namespace(self, host: str) -> str:
        return f"{NS_PREFIX}{self.tag}-{host}"

    def _ifname(self, kind: str, n: int | str = "") -> str:
        return f"dd{self.tag}-{kind}{n}"

    @property
    def gateway(self) -> str:
        """The launcher's own address on the bridge."""
        return f"{self.subnet}.1"

    def address(self, host: str) -> str:
        return f"{self.subnet}.{self.hosts.index(host) + 2}"

    def prefix(self, host: str) -> list[str]:
        """The command line prefix that runs a command inside ``host``'s namespace."""
        return ["ip", "netns", "exec", self.namespace(host)]

    def link_of(self, host: str) -> Link:
        return self.topology.sync if host == SYNC_HOST else self.topology.region_of(host).link

    # ---- building and removing ----------------------------------------------------------

    def _build(self) -> None:
        core = self._ifname("b")
        self._add_link(core, "type", "bridge")
        _run("ip", "addr", "add", f"{self.gateway}/24", "dev", core)
        _run("ip", "link", "set", core, "up")
        bridges = {}
        for j, region in enumerate(self.topology.regions):
            if len(region.learners) > 1 and any(h in self.hosts for h in region.learners):
                bridge, inner, outer = self._ifname("b", j), self._ifname("r", j), self._ifname("c", j)
                self._add_link(bridge, "type", "bridge")
                self._add_link(outer, "type", "veth", "peer", "name", inner)
                _run("ip", "link", "set", inner, "master", bridge, "up")
                _run("ip", "link", "set", outer, "master", core, "up")
                _run("ip", "link", "set", bridge, "up")
                _shape(outer, None, region.link.down_bps)
                _shape(inner, None, region.link.up_bps)
                bridges[region.name] = bridge
                self.trunks[region.name] = outer
        for i, host in enumerate(self.hosts):
            ns, outer = self.namespace(host), self._ifname("h", i)
            _run("ip", "netns", "add", ns)
            self.created.append(ns)
            self._add_link(outer, "type", "veth", "peer", "name", INNER_IFNAME, "netns", ns)
            shared = host != SYNC_HOST and self.topology.region_of(host).name in bridges
            _run("ip", "link", "set", outer, "master",
                 bridges[self.topology.region_of(host).name] if shared else core, "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", INNER_IFNAME)
            _run("ip", "-n", ns, "link", "set", INNER_IFNAME, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            self.links[host] = _HostLink(outer, Link() if shared else self.link_of(host))
            self.set_rate(host, None)

    def _add_link(self, name: str, *spec: str) -> None:
        _run("ip", "link", "add", name, *spec)
        self.created.append(name)

    def remove(self) -> None:
        """Delete every namespace and link of this run (namespaces take their veth ends and qdiscs)."""
        for name in reversed(self.created):
            if name.startswith(NS_PREFIX):
                _remove_namespace(name)
            else:
                _run("ip", "link", "del", name, check=False)
        self.created.clear()
        _ACTIVE.discard(self.tag)

    # ---- faults and counters ---------------------------------------------------------------

    def set_rate(self, host: str, rate_bps: float | None) -> None:
        """Cap ``host``'s own link at ``rate_bps`` each way; None restores its topology's caps."""
        own = self.links[host]
        link = own.link if rate_bps is None else Link(rate_bps, rate_bps)
        _shape(own.outer, None, link.down_bps)
        _shape(INNER_IFNAME, self.namespace(host), link.up_bps)

    def set_down(self, host: str, down: bool) -> None:
        """Take ``host``'s link down (nothing passes either way) or bring it back up."""
        _run("ip", "link", "set", self.links[host].outer, "down" if down else "up")

    def counters(self) -> dict[str, dict[str, int]]:
        """Bytes so far per link and direction: each host's own link, and each shared region link
        (``region:<name>``); up is out of the host or region, down into it."""
        named = {host: own.outer for host, own in self.links.items()}
        named.update({f"region:{name}": outer for name, outer in self.trunks.items()})
        out = {}
        for name, ifname in named.items():
            stats = Path("/sys/class/net") / ifname / "statistics"
            # The bridge's end: what it receives came up from the host, what it sends goes down to it.
            out[name] = {"up": int((stats / "rx_bytes").read_text()), "down": int((stats / "tx_bytes").read_text())}
        return out

    def qdisc_stats(self, host: str) -> list[str]:
        """``tc -s qdisc`` of both ends of ``host``'s own link (the caps in force, sent bytes, overlimits)."""
        return [_run("tc", "-s", "qdisc", "show", "dev", self.links[host].outer).stdout,
                _run("tc", "-n", self.namespace(host), "-s", "qdisc", "show", "dev", INNER_IFNAME).stdout]


def _shape(ifname: str, namespace: str | None, rate_bps: float | None) -> None:
    """The egress of ``ifname``: a token bucket at ``rate_bps``, or the default queue (None)."""
    tc = ["tc", *(["-n", namespace] if namespace else [])]
    if rate_bps is None:
        _run(*tc, "qdisc", "del", "dev", ifname, "root", check=False)  # no cap: nothing to delete is fine
        return
    burst = max(MIN_BURST_BYTES, int(rate_bps / 8 * TBF_BURST_S))
    _run(*tc, "qdisc", "replace", "dev", ifname, "root", "tbf", "rate", f"{int(rate_bps)}bit",
         "burst", str(burst), "latency", TBF_LATENCY)


def _free_subnet() -> str:
    """The first 10.250.X (X in 1..254) that no interface of this namespace uses."""
    used = _run("ip", "-4", "-o", "addr", "show").stdout
    for x in range(1, 255):
        if f" {SUBNET}.{x}." not in used:
            return f"{SUBNET}.{x}"
    raise DdilocoError(f"no free {SUBNET}.X.0/24 subnet left on this machine for --hosts netns")
