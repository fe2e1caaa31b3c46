"""The real runtime: the synchronizer and learner processes of a run, over gRPC.

- :mod:`ddiloco.runtime.sync`: the synchronizer process (the service around the core, its
  boundary, streams, checkpoints and metrics);
- :mod:`ddiloco.runtime.learner`: a learner process (``LearnerRuntime`` inside any training
  loop, its background link to the synchronizer, the reference learner process);
- :mod:`ddiloco.runtime.launch`: starting a whole run on one machine (processes, network
  namespaces and capped links, ``ddiloco launch``);
- :mod:`ddiloco.runtime.status`: the Status call and the status page, both sides of the wire;
- :mod:`ddiloco.runtime.proto`: the wire schema (``ddiloco.proto``) and protoc's output.

Shared by both sides:

- :mod:`~ddiloco.runtime.wire`: every conversion between the core's messages and protobuf, the
  chunking of large payloads, message sizes and channel options, written once for client and server;
- :mod:`~ddiloco.runtime.auth`: addresses, the shared token, per-learner credentials and TLS;
- :mod:`~ddiloco.runtime.layout`: the model a synchronizer serves (fragments, initial values,
  shapes), which a learner checks at its join and a checkpoint carries the hash of;
- :mod:`~ddiloco.runtime.client`: the blocking client of the synchronizer, every call with a
  deadline, failures as refused, unauthenticated or unreachable;
- :mod:`~ddiloco.runtime.call_errors`: how a failed call reads (its reason, or unreachable),
  without torch, for the client and ``ddiloco status``;
- :mod:`~ddiloco.runtime.sharded`: a synchronizer sharded by fragment read as one: merged status
  and global state;
- :mod:`~ddiloco.runtime.http_probe`: whether an address gRPC cannot talk to is the status page
  or the metrics port, to say which one the operator reached;
- :mod:`~ddiloco.runtime.progress`: a process's own step count in a small JSON file its launcher
  reads (the synchronizer cannot see steps whose work never arrives);
- :mod:`~ddiloco.runtime.batch_log`: which batches each learner process trained, appended so it
  survives ``kill -9``: the evidence ``ddiloco chaos`` counts retrained batches from;
- :mod:`~ddiloco.runtime.script_env`: what ``ddiloco launch`` tells each copy of a user's script
  through its environment (read by ``LearnerRuntime.from_env``).
"""
