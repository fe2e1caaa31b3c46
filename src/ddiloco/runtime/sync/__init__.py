"""The synchronizer process: the gRPC service that runs the protocol core for a run. The core
decides; these modules move bytes in and out of it, bound what callers hold, keep its state on
disk and say what it is doing.

- :mod:`~ddiloco.runtime.sync.server`: serving the service over gRPC: bind, run, shut down on a signal;
- :mod:`~ddiloco.runtime.sync.service`: the gRPC handlers, which parse requests themselves so a
  malformed one is counted and answered with a named reason;
- :mod:`~ddiloco.runtime.sync.service_records`: what the service keeps beside the core (counters,
  byte ledger, goodput) and makes of the host's reports after every event;
- :mod:`~ddiloco.runtime.sync.core_host`: the one thread that touches the core, and the carrying-out
  of its actions (round log, broadcasts, stops, timers);
- :mod:`~ddiloco.runtime.sync.boundary`: what is checked and counted before a message reaches the
  core (caller, protocol version, syntax, chunks, upload size);
- :mod:`~ddiloco.runtime.sync.call_limits`: the calls a caller may hold, per host, per learner and
  in all, and the deadline every stream is held to;
- :mod:`~ddiloco.runtime.sync.uploads`: an upload from its header to a contribution the core can
  judge, refused before any payload is read if its session is not live;
- :mod:`~ddiloco.runtime.sync.streams`: the learners' update streams, each broadcast serialized
  once per cut and queued to every recipient;
- :mod:`~ddiloco.runtime.sync.slice_parts`: a sharded learner's rank receives only its own slice of
  the state and of every update;
- :mod:`~ddiloco.runtime.sync.state_copies`: fragment copies for joins and state fetches, shared
  while sent and released only once durable;
- :mod:`~ddiloco.runtime.sync.round_log`: every merged round's update on disk before any learner
  receives it, replayed after the latest checkpoint on a restart;
- :mod:`~ddiloco.runtime.sync.state_dir`: the locked state directory and its checkpoints, a
  fragment per file, made latest by one atomic rename;
- :mod:`~ddiloco.runtime.sync.checkpoint_writer`: writing the core's checkpoints in the background a
  fragment at a time, and restoring from the latest with the round log;
- :mod:`~ddiloco.runtime.sync.resume`: ``--resume``'s choices, checked without torch;
- :mod:`~ddiloco.runtime.sync.model_export`: the global model as a plain ``state_dict`` file, from a
  state directory or a running synchronizer (``ddiloco export``);
- :mod:`~ddiloco.runtime.sync.memory`: the memory a synchronizer holds for its model, logged at
  start and checked against the host;
- :mod:`~ddiloco.runtime.sync.metrics`: goodput and Prometheus counters of a real run, kept outside
  the core with bounded memory;
- :mod:`~ddiloco.runtime.sync.status_reply`: the Status call's answer: the core's status plus what
  only the service measures, a page of learners at a time;
- :mod:`~ddiloco.runtime.sync.shutdown`: one stop's deadline shared by every wait on the shutdown
  path, so SIGTERM ends the process in bounded time.
"""
