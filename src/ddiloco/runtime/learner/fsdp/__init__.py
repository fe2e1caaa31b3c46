"""A learner that is an FSDP2 job: every rank runs its own core over its own slice of each fragment.

``LearnerRuntime`` hands a model whose parameters are FSDP2 shards to
:class:`~ddiloco.runtime.learner.fsdp.fsdp_runtime.FsdpLearnerRuntime`; the helper process, its
slots and its wire are the single-process learner's (:mod:`ddiloco.runtime.learner`).

- :mod:`~ddiloco.runtime.learner.fsdp.fsdp_runtime`: the runtime when the model's parameters are
  FSDP2 shards: a core per rank, kept identical by an exchange after every step;
- :mod:`~ddiloco.runtime.learner.fsdp.rank_link`: one rank's own connection (its helper, its slots),
  recording outcomes for the training thread to apply on every rank at once;
- :mod:`~ddiloco.runtime.learner.fsdp.rank_params`: the rank's parameters checked to be placed as the
  slice arithmetic assumes, refused in one line otherwise;
- :mod:`~ddiloco.runtime.learner.fsdp.held_updates`: the updates a rank received and its core has not
  applied yet, applied by all ranks up to the smallest reach.
"""
