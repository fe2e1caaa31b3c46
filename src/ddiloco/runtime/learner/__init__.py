"""A learner process: Decoupled DiLoCo inside any PyTorch training loop.

``from ddiloco.runtime.learner import LearnerRuntime`` wraps a model you train yourself
(:mod:`~ddiloco.runtime.learner.runtime`); its background threads talk to the synchronizer
(:mod:`~ddiloco.runtime.learner.link`); ``ddiloco learner`` is the reference learner process
(:mod:`~ddiloco.runtime.learner.process`).
"""

from ddiloco.runtime.learner.runtime import LayoutMismatch, LearnerRuntime, RuntimeStats, save_initial_state

__all__ = ["LayoutMismatch", "LearnerRuntime", "RuntimeStats", "save_initial_state"]
