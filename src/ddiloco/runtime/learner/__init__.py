"""A learner process: Decoupled DiLoCo inside any PyTorch training loop.

``from ddiloco.runtime.learner import LearnerRuntime`` wraps a model you train yourself
(:mod:`~ddiloco.runtime.learner.runtime`); its link talks to the synchronizer through a
helper process (:mod:`~ddiloco.runtime.learner.link`, :mod:`~ddiloco.runtime.learner.helper`);
``ddiloco learner``, the reference learner process, is an application of it, one layer up
(:mod:`ddiloco.commands.learner_process`).

The names below are imported when first asked for (PEP 562), not with the package: the helper
process starts from ``ddiloco.runtime.learner.helper`` once per learner, and importing the
training side with it (the runtime, its link, torch's distributed and the model files) cost each
helper a second or more of CPU beside its trainer.

The training process:

- :mod:`~ddiloco.runtime.learner.runtime`: ``LearnerRuntime``: Decoupled DiLoCo inside your own
  training loop; ``step`` never waits for the network;
- :mod:`~ddiloco.runtime.learner.link`: the link as the training process sees it: it writes due
  Δs into slots, announces them, and feeds the core each outcome the helper reports;
- :mod:`~ddiloco.runtime.learner.calls`: the calls handed to the helper, remembered until their
  outcome or the helper's death (then reported undelivered);
- :mod:`~ddiloco.runtime.learner.out_slots`: how a due fragment's Δ gets into its out slot, by the
  training thread on the CPU or by an asynchronous device copy on a GPU;
- :mod:`~ddiloco.runtime.learner.staging`: host-device copies on a side stream, so the training
  stream never waits for Δ out or an update in;
- :mod:`~ddiloco.runtime.learner.ranks`: what rank 0 tells the other ranks of a ``torchrun`` learner
  after every step (stop, changed fragments, their values);
- :mod:`~ddiloco.runtime.learner.connect`: reaching the run's synchronizer before the core takes
  over: the probe that waits for it, every shard's client checked to be one run;
- :mod:`~ddiloco.runtime.learner.link_lines`: the warnings the link logs about its own health
  (starved, behind, stale, an outage);
- :mod:`~ddiloco.runtime.learner.stats`: what a runtime did so far, one type for the unsharded and
  the sharded runtime.

The helper process and what it shares with the trainer:

- :mod:`~ddiloco.runtime.learner.helper`: the process that talks to the synchronizer (gRPC,
  compression, decoding, retries, update streams), so the trainer's interpreter is left to training;
- :mod:`~ddiloco.runtime.learner.helper_process`: starting the helper as a fresh interpreter and
  ending it, a failed start reported in one line;
- :mod:`~ddiloco.runtime.learner.helper_relay`: the relay thread that keeps a link's helper running
  (started, served, replaced when it dies, closed), for both links;
- :mod:`~ddiloco.runtime.learner.helper_wire`: the small control messages between trainer and
  helper on a socket pair, and a join's state as a shared file;
- :mod:`~ddiloco.runtime.learner.slots`: the fixed shared-memory slots (out: Δ, in: updates), each
  guarded like a seqlock so a torn copy is never sent or applied;
- :mod:`~ddiloco.runtime.learner.link_layout`: what the slots hold per fragment and what the helper
  is told at start, from where Δ is compressed and updates decoded;
- :mod:`~ddiloco.runtime.learner.repeats`: refusals said once per reason, and the jittered backoff
  of retries (trainer and helper alike).

A learner that is an FSDP2 job, every rank streaming its own slice of each fragment:

- :mod:`~ddiloco.runtime.learner.fsdp`: its runtime, each rank's link, its parameters' placement and
  the updates its ranks hold, apart from the single-process learner above.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ddiloco.runtime.learner.runtime import LayoutMismatch, LearnerRuntime, RuntimeStats, save_initial_state

__all__ = ["LayoutMismatch", "LearnerRuntime", "RuntimeStats", "save_initial_state"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("ddiloco.runtime.learner.runtime"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
