"""The real runtime: the synchronizer and learner processes of a run, over gRPC.

- :mod:`ddiloco.runtime.sync`: the synchronizer process (the service around the core, its
  boundary, streams, checkpoints, status page and metrics);
- :mod:`ddiloco.runtime.learner`: a learner process (``LearnerRuntime`` inside any training
  loop, its background link to the synchronizer, the reference learner process);
- :mod:`ddiloco.runtime.launch`: starting a whole run on one machine (processes, network
  namespaces and capped links, real data parallel);
- shared by both sides: the wire (:mod:`~ddiloco.runtime.wire`, the ``proto`` schema,
  :mod:`~ddiloco.runtime.auth`), the model layout a synchronizer serves
  (:mod:`~ddiloco.runtime.layout`), the client (:mod:`~ddiloco.runtime.client`,
  :mod:`~ddiloco.runtime.sharded`), atomic checkpoint files and progress files.
"""
