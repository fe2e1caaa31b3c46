"""Chaos engineering on real processes (``ddiloco chaos``).

The protocol's reactions (rejoin, lease, resume) are the core's: this package only breaks
things and watches.

- :mod:`~ddiloco.chaos.schedule`: fault kinds and validated schedules (seeded, or from a TOML
  file), checked once when built;
- :mod:`~ddiloco.chaos.proxy`: the fault-injecting TCP proxy on each learner's link (latency,
  bandwidth cap, resets, partitions), without knowing the protocol;
- :mod:`~ddiloco.chaos.cluster`: the running processes and proxies of a chaos run, and how each
  fault reaches them (signals, proxies, or with ``--hosts netns`` the real links);
- :mod:`~ddiloco.chaos.runner`: starts the processes, injects the faults on schedule, polls the
  synchronizer's status, and stops everything cleanly;
- :mod:`~ddiloco.chaos.outcome`: what a run records while it goes (faults, status polls,
  restarts) and its outcome;
- :mod:`~ddiloco.chaos.report`: chaos.json, the properties it must hold, its table and timeline plot;
- :mod:`~ddiloco.chaos.batch_counts`: batches a restarted learner trained twice or skipped,
  from its batch log, against the one-period allowance;
- :mod:`~ddiloco.chaos.soak`: thousands of kills in one run, sampling the processes' memory,
  descriptors, threads and state directory to show that none grows.
"""
