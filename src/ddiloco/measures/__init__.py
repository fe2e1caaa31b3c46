"""What both drivers measure the same way (the protocol core measures nothing of the kind).

- :mod:`~ddiloco.measures.wire_bytes`: bytes on the wire per learner, fragment and direction, and
  data parallel's bytes per step (for the simulated baseline and real data parallel alike);
- :mod:`~ddiloco.measures.useful_work`: the time covered by useful work, each fragment's share of it, and
  the virtual cluster's goodput and uptime from every step's start, end and credit.
"""
