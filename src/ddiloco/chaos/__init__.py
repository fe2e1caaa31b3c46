"""Chaos engineering on real processes (``ddiloco chaos``).

``schedule``: fault kinds and validated schedules (seeded or from TOML); ``proxy``: the
fault-injecting TCP proxy on each learner's link; ``runner``: starts the processes, injects
the faults, watches the synchronizer; ``report``: chaos.json, its properties, table and plot.
The protocol's reactions (rejoin, lease, resume) are the core's: this package only breaks
things and watches.
"""
