"""The virtual cluster: one process and one virtual clock driving the real protocol core, with
real models and seeded faults, so the same seed gives the same run bit for bit.

- :mod:`~ddiloco.sim.virtual_cluster`: the discrete-event driver that moves messages between the
  learners' and the synchronizer's cores and carries out their actions;
- :mod:`~ddiloco.sim.events`: the clock, a priority queue of typed events ordered by (time, sequence);
- :mod:`~ddiloco.sim.host`: what a node may ask of the cluster that drives it, and nothing else;
- :mod:`~ddiloco.sim.learner_node`: a learner process (model, trainer, core) over the virtual
  network, which crashes, restarts, freezes;
- :mod:`~ddiloco.sim.sync_node`: the synchronizer process with its checkpoints and round log,
  crashed and restarted as a new incarnation;
- :mod:`~ddiloco.sim.network`: virtual links (latency + bits / bandwidth, every byte counted) that
  the adversary may lose, duplicate, delay or partition;
- :mod:`~ddiloco.sim.faults`: seeded failure traces (when each learner goes down and comes back),
  the same for every mode so a comparison sees the same failures;
- :mod:`~ddiloco.sim.adversary`: the timed attacks (partitions, freezes, synchronizer crashes,
  join floods) as seeded Poisson windows;
- :mod:`~ddiloco.sim.fate`: the trace's crashes and the adversary's faults as events on the clock;
- :mod:`~ddiloco.sim.speed`: each learner's step time (hardware generation times seeded jitter);
- :mod:`~ddiloco.sim.invariants`: the safety properties checked after every event (quorum,
  versions, staleness, tokens, anchors), a violation naming its seed;
- :mod:`~ddiloco.sim.timeline`: what happened, in order, from which the summary's events, the
  live view and the plot's marks are computed;
- :mod:`~ddiloco.sim.snapshot`: read-only views of a running cluster for the live view, which
  change no state and draw no random number;
- :mod:`~ddiloco.sim.data_stream`: batches each learner trained again, skipped or merged twice
  across its restarts;
- :mod:`~ddiloco.sim.harness`: what every mode of a virtual run shares (failure trace, speeds,
  evaluation schedule) and the recorder of what it measures;
- :mod:`~ddiloco.sim.dp_baselines`: data parallel (``dp``, ``dp-elastic``) simulated on the same
  workload and failure trace;
- :mod:`~ddiloco.sim.experiment`: run one mode on the virtual cluster (``ddiloco run``'s default
  runtime), or warm-started;
- :mod:`~ddiloco.sim.synthetic`: a seeded random-walk workload that stands in for the transformer
  so hundreds of seeds run in minutes;
- :mod:`~ddiloco.sim.swarm`: swarm simulation testing (``ddiloco simtest``): a world per seed, a
  safety phase under faults, then a liveness bound;
- :mod:`~ddiloco.sim.behaviour_fingerprint`: one hash of the protocol's decisions in a fixed set of
  seeded worlds (``ddiloco fingerprint``), which changes when a rule does.
"""
