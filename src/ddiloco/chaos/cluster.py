"""The running pieces of a chaos run, and how each fault reaches them.

Processes are the launcher's (:mod:`ddiloco.runtime.launch.launcher`): one ``ddiloco sync`` per
shard and M ``ddiloco learner`` processes, the learners reaching every shard through a
fault-injecting proxy of their own (:mod:`ddiloco.chaos.proxy`). Signals (learner_crash,
freeze, sync_crash) go to processes. Link faults go to the learner's proxies on loopback; with
``--hosts netns`` (:mod:`ddiloco.runtime.launch.netns`) a partition takes the learner's real link
down and a bandwidth fault replaces its ``tc`` qdisc, while the proxies (listening on the
launcher's bridge address, on the path of every learner's link) keep latency and resets.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ddiloco.chaos.proxy import ProxyHost
from ddiloco.chaos.schedule import Fault
from ddiloco.runtime.launch.command_lines import learner_command
from ddiloco.runtime.launch.local_run import RunFiles, Synchronizers
from ddiloco.runtime.launch.placement import Placement
from ddiloco.runtime.launch.processes import Processes
from ddiloco.settings.fault_kinds import FaultKind

BATCH_LOGS = "batches"
"""The folder of the run's directory that holds each learner's batch log."""


@dataclass
class ChaosCluster:
    """Processes, proxies and hosts of one chaos run."""

    procs: Processes
    proxies: ProxyHost
    files: RunFiles
    synchronizers: Synchronizers
    learner_cmds: dict[str, list[str]] = field(default_factory=dict)
    links: dict[str, list[str]] = field(default_factory=dict)
    """Learner -> the names of its proxies (one per synchronizer shard)."""

    @property
    def place(self) -> Placement:
        return self.synchronizers.place

    @property
    def syncs(self) -> list[str]:
        return self.synchronizers.names

    def batch_log(self, name: str) -> Path:
        """Learner ``name``'s batch log (``runtime/batch_log.py``): every process of it appends there."""
        return self.files.out / BATCH_LOGS / f"{name}.log"

    def add_learner(self, name: str, device: str, min_step_s: float) -> None:
        """A proxy per shard in front of ``name``'s connections, and its command line."""
        host, _ = self.place.sync_listen(0)
        self.links[name] = [name if len(self.syncs) == 1 else f"{name}/{sync}" for sync in self.syncs]
        gateway = self.place.gateway
        addresses = [f"{gateway}:{self.proxies.add(proxy, port, upstream_host=host, listen_host=gateway)}"
                     for proxy, port in zip(self.links[name], self.synchronizers.ports)]
        self.learner_cmds[name] = learner_command(addresses, name, self.files.threads, device, min_step_s,
                                                  token_file=self.place.token_file, batch_log=self.batch_log(name))

    def start_learner(self, name: str) -> None:
        self.procs.start(name, self.learner_cmds[name], env={"OMP_NUM_THREADS": str(self.files.threads)},
                         prefix=self.place.prefix(name))

    # ---- link faults ---------------------------------------------------------------------------

    def break_link(self, f: Fault) -> None:
        """Start link fault ``f`` on its learner's link."""
        net = self.place.net
        if net is not None and f.kind is FaultKind.PARTITION:
            net.set_down(f.target, True)
        elif net is not None and f.kind is FaultKind.BANDWIDTH:
            net.set_rate(f.target, f.rate_bytes_per_s * 8)
        else:
            self._each_proxy(f.target, {
                FaultKind.LATENCY: lambda p: p.set_latency(f.delay_s),
                FaultKind.BANDWIDTH: lambda p: p.set_bandwidth(f.rate_bytes_per_s),
                FaultKind.RESET: lambda p: p.reset(f.duration_s),
                FaultKind.PARTITION: lambda p: p.set_partitioned(True),
            }[f.kind])

    def heal_link(self, f: Fault) -> None:
        """End link fault ``f`` (a reset's hold runs out by itself)."""
        net = self.place.net
        if net is not None and f.kind is FaultKind.PARTITION:
            net.set_down(f.target, False)
        elif net is not None and f.kind is FaultKind.BANDWIDTH:
            net.set_rate(f.target, None)
        elif f.kind is not FaultKind.RESET:
            self._each_proxy(f.target, {
                FaultKind.LATENCY: lambda p: p.set_latency(0.0),
                FaultKind.BANDWIDTH: lambda p: p.set_bandwidth(0.0),
                FaultKind.PARTITION: lambda p: p.set_partitioned(False),
            }[f.kind])

    def _each_proxy(self, learner: str, act: Callable) -> None:
        proxies = [self.proxies.proxies[name] for name in self.links[learner]]

        def run() -> None:
            for proxy in proxies:
                act(proxy)

        self.proxies.call(run)

    def signal(self, name: str, sig: signal.Signals) -> bool:
        return self.procs.signal(name, sig)
